"""The AT-GRPO paper's planning puzzles as tasks (arXiv 2510.11062; the reference's "stateful" environments):
`plan_path`, `sokoban` and `sudoku`, each played by a `tool` agent and a `plan` agent.

At every turn the tool agent writes a Python program that prints a proposed list of actions; the program runs in the
sandbox (`trl_marl.sandbox`, short limits) and its proposal is played on a copy of the board, which gives the tool
its local reward. The plan agent then sees the board and the tool's reply (the `sequential` scheduler) and commits
actions: only its answer changes the board. Turns repeat until the puzzle is solved or the turn limit (`num_turns`).

Team reward (`puzzle_reward`): the episode's shaped return so far (`common.play`, constants per puzzle), with the
failure penalty once the last turn ends unsolved. Local rewards: the shaped reward of the agent's own proposal from
the state it saw (`shaping.no_proposal` when it proposed nothing: a crash, a timeout, no output, no action).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from datasets import Dataset

from ...rollouts.rollout import NextTurn
from ...sandbox import Limits
from ..base import Task
from ..completions import completion_text
from ..sandbox_runs import extract_code, shared_sandbox
from .common import PLAN, TOOL, Proposal, Puzzle, PuzzleState, play
from .plan_path import PATH_DIFFICULTIES, PLAN_PATH
from .sokoban import SOKOBAN, SOKOBAN_DIFFICULTIES
from .sudoku import SUDOKU, SUDOKU_DIFFICULTIES

PUZZLES: dict[str, Puzzle] = {PLAN_PATH.name: PLAN_PATH, SOKOBAN.name: SOKOBAN, SUDOKU.name: SUDOKU}
# Ours: a BFS over these boards takes milliseconds; the reference allows 20 s per program.
TOOL_LIMITS = Limits(wall_time_s=5.0, memory_bytes=256 * 2**20, output_bytes=64 * 2**10)
TOOL_OUTPUT_CHARS = 300  # the end of the tool's output shown in the next prompt (the reference truncates to 300)
TRAIN_SEED, EVAL_SEED = 0, 1_000_000  # the splits' first generator seeds: disjoint seed ranges
MAX_SEEDS_PER_PUZZLE = 20  # seeds tried per wanted puzzle before a split gives up (duplicates are skipped)
# T: the reference's Qwen3-1.7B puzzle scripts set env.max_turns=4 (scripts/train/game/sokoban_prompt_1.7B_at_grpo.sh,
# scripts/sokodu.sh)
TURN_LIMIT = 4

TOOL_PROMPT = (
    "You are the tool agent of a two-agent puzzle team. Write one short Python program in a ```python block that "
    "solves the puzzle from the current board (for example with breadth-first search) and prints its solution as one "
    "line 'Answer: <actions>'. The board, as drawn, is also on standard input. The program runs in a sandbox: "
    "standard library only, no files or network, a few seconds."
)
PLAN_PROMPT = (
    "You are the plan agent of a two-agent puzzle team. Read the board and your teammate's program, decide which "
    "actions to take now, and end your reply with one line 'Answer: <actions>'. Only your answer changes the board."
)
PUZZLE_AGENTS = [{"name": TOOL, "system_prompt": TOOL_PROMPT}, {"name": PLAN, "system_prompt": PLAN_PROMPT}]


# ---------------------------------------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class ToolRun:
    """The tool's program run: its proposed actions (None: none), a status, and the end of its output."""

    actions: list | None
    status: str  # "ok", "no_actions", "syntax_error", or the sandbox's status ("timeout", "error", "memory", ...)
    output: str


def run_tool(puzzle: Puzzle, board: Any, text: str, sandbox=None) -> ToolRun:
    """Run the program in the tool's reply (its fenced code, else the whole reply) in the sandbox with `TOOL_LIMITS`,
    the board drawn on standard input, and read its proposal from what it printed. Code that does not compile is not
    run. Never raises for anything the program does."""
    code = extract_code(text)
    try:
        compile(code, "tool.py", "exec")
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return ToolRun(None, "syntax_error", "")
    result = (sandbox or shared_sandbox()).run(code, stdin=puzzle.render(board) + "\n", limits=TOOL_LIMITS)
    if not result.ok:
        return ToolRun(None, result.status.value, (result.reason or "")[:TOOL_OUTPUT_CHARS])
    actions = puzzle.parse(result.stdout, board)
    return ToolRun(actions or None, "ok" if actions else "no_actions", result.stdout[-TOOL_OUTPUT_CHARS:].strip())


def tool_report(puzzle: Puzzle, run: ToolRun) -> str:
    """What the tool's program did, in words, for the next prompt."""
    if run.status == "ok":
        return f"The tool agent's program printed {run.output!r}: it proposed {puzzle.format_actions(run.actions)}."
    if run.status == "no_actions":
        return f"The tool agent's program ran but printed no actions ({run.output!r})."
    if run.status == "syntax_error":
        return "The tool agent's reply had no Python program that compiles."
    return f"The tool agent's program did not finish: {run.status} ({run.output})."


def propose(puzzle: Puzzle, state: PuzzleState, text: str, sandbox=None) -> PuzzleState:
    """The tool's step: run its program and score its proposal on a copy of the board; the board does not change."""
    run = run_tool(puzzle, state.board, text, sandbox)
    if run.actions:
        reward = play(puzzle, state.board, run.actions, state.attempts, state.optimum).reward
    else:
        reward = puzzle.shaping.no_proposal
    actions = tuple(run.actions) if run.actions else None
    state.proposal = Proposal(TOOL, actions, run.status, run.output, reward)
    state.tool_report = tool_report(puzzle, run)
    return state


def commit(puzzle: Puzzle, state: PuzzleState, agent: str, text: str, last_turn: bool) -> PuzzleState:
    """The plan's step: play the actions of its answer on the board. After the last turn an unsolved episode fails
    (`shaping.failure`, once)."""
    actions = puzzle.parse(text, state.board)
    outcome = play(puzzle, state.board, actions, state.attempts, state.optimum)
    state.board = outcome.board
    state.attempts += outcome.valid + outcome.invalid
    state.invalid += outcome.invalid
    state.total += outcome.reward
    state.committed.extend(outcome.played)
    state.solved = outcome.solved
    local = outcome.reward if actions else puzzle.shaping.no_proposal
    state.proposal = Proposal(agent, tuple(actions) if actions else None, "committed", "", local)
    if last_turn and not state.solved and not state.failed:
        state.total += puzzle.shaping.failure
        state.failed = True
    return state


# ---------------------------------------------------------------------------------------------------------- rewards


def initial_state(puzzle: str, board: str, optimal_actions: int | None = None) -> PuzzleState:
    """The state at the start of an episode, from a dataset row's `puzzle`, `board` and `optimal_actions` cells."""
    if puzzle not in PUZZLES:
        raise ValueError(f"Unknown puzzle {puzzle!r}: the puzzles are {sorted(PUZZLES)}.")
    environment = PUZZLES[puzzle]
    start = environment.from_json(board)
    if optimal_actions is None:
        solution = environment.solve(start)
        if solution is None:
            raise ValueError(f"The {puzzle} board {board} has no solution.")
        optimal_actions = len(solution)
    return PuzzleState(puzzle, start, int(optimal_actions))


def _column(values: list | None, count: int) -> list:
    return list(values) if values is not None else [None] * count


def puzzle_reward(prompts, completions, state=None, puzzle=None, board=None, optimal_actions=None, log_metric=None,
                  **kwargs) -> list[float]:  # fmt: skip
    """Team reward of the puzzle tasks: the episode's shaped return so far (`PuzzleState.total`), from the tasks'
    environment state. Without a state (a single-turn use on the dataset alone) it plays the `plan` agent's answer
    (or a lone agent's) from the row's board as a one-turn episode. In a trainer it logs `puzzles/solved`, the share
    of scored states that are solved."""
    if state is None:
        if puzzle is None or board is None:
            raise ValueError(
                "puzzle_reward needs the puzzle tasks' environment state (`state`), or the dataset columns `puzzle` "
                "and `board` to play one answer from the start."
            )
        optimum = _column(optimal_actions, len(completions))
        # The plan agent's answer, or a lone agent's (a `single` baseline) standing for it.
        answers = [completion_text(completion, PLAN, fallback_to_last=True) for completion in completions]
        state = [
            commit(PUZZLES[name], initial_state(name, cell, best), PLAN, answer, last_turn=True)
            for answer, name, cell, best in zip(answers, puzzle, board, optimum)
        ]
    if log_metric is not None and state:
        log_metric("puzzles/solved", sum(s.solved for s in state) / len(state))
    return [s.total for s in state]


def _own_proposal_reward(agent: str, completions, state, puzzle, board, optimal_actions) -> list[float]:
    if state is not None:
        return [s.proposal.reward if s.proposal is not None else 0.0 for s in state]
    # MAGRPO logs local rewards without the state: judge the proposal from the episode's initial board.
    rewards = []
    for text, name, cell, best in zip(completions, puzzle, board, _column(optimal_actions, len(completions))):
        environment, start = PUZZLES[name], initial_state(name, cell, best)
        after = propose(environment, start, text) if agent == TOOL else commit(environment, start, agent, text, False)
        rewards.append(after.proposal.reward)
    return rewards


def tool_proposal_reward(prompts, completions, state=None, puzzle=None, board=None, optimal_actions=None,
                         **kwargs) -> list[float]:  # fmt: skip
    """Local reward of the tool agent: the shaped reward its program's proposal would earn if committed from the
    state it saw (`shaping.no_proposal` for a crash, a timeout, or no action printed)."""
    return _own_proposal_reward(TOOL, completions, state, puzzle, board, optimal_actions)


def plan_proposal_reward(prompts, completions, state=None, puzzle=None, board=None, optimal_actions=None,
                         **kwargs) -> list[float]:  # fmt: skip
    """Local reward of the plan agent: the shaped reward of the actions it committed (`shaping.no_proposal` when its
    answer has no action)."""
    return _own_proposal_reward(PLAN, completions, state, puzzle, board, optimal_actions)


# ---------------------------------------------------------------------------------------------------------- tasks


def first_prompt(puzzle: Puzzle, board: Any, num_turns: int) -> list[dict]:
    content = (
        f"{puzzle.describe(board)}\n\n"
        f"Your team has {num_turns} turns. At each turn the tool agent writes a Python program that prints a proposed "
        "list of actions, then the plan agent commits actions. Actions are read after the last 'Answer:', for "
        f"example '{puzzle.answer_example}'."
    )
    return [{"role": "user", "content": content}]


class PuzzleTask(Task):
    """A planning puzzle played by `tool` and `plan` (see the module docstring). Subclasses set `puzzle` and
    `difficulties` (named generator settings; "paper" is the default).

    Args:
        difficulty: a name of `difficulties` or the puzzle's difficulty object (e.g. `PathDifficulty(rows=6, ...)`).
        num_turns: the turn limit (default 4); an unsolved episode fails after it.
        train_size, eval_size: puzzles per split, generated from disjoint seed ranges (`TRAIN_SEED`, `EVAL_SEED`);
            an eval puzzle never repeats a train puzzle.
    """

    puzzle: Puzzle
    difficulties: dict[str, Any] = {}
    agents = PUZZLE_AGENTS
    num_turns = TURN_LIMIT
    scheduler = "sequential"
    reward_funcs = [puzzle_reward]
    local_reward_funcs = {TOOL: [tool_proposal_reward], PLAN: [plan_proposal_reward]}
    train_size = 200
    eval_size = 50

    def __init__(self, difficulty: str | Any = "paper", num_turns: int | None = None, train_size: int | None = None,
                 eval_size: int | None = None):  # fmt: skip
        if not self.difficulties:
            raise TypeError("PuzzleTask is a base class: use PlanPathTask, SokobanTask or SudokuTask.")
        if isinstance(difficulty, str):
            if difficulty not in self.difficulties:
                raise ValueError(
                    f"Unknown {self.name} difficulty {difficulty!r}: choose one of {sorted(self.difficulties)} or "
                    f"pass a {type(self.difficulties['paper']).__name__}."
                )
            difficulty = self.difficulties[difficulty]
        if not isinstance(difficulty, type(self.difficulties["paper"])):
            raise TypeError(
                f"`difficulty` of {self.name} must be a name or a {type(self.difficulties['paper']).__name__}, got "
                f"{difficulty!r}."
            )
        self.difficulty = difficulty
        for name, value in (("num_turns", num_turns), ("train_size", train_size), ("eval_size", eval_size)):
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
                setattr(self, name, value)
        self._rows: dict[str, dict] = {}

    # The data: generated offline, deterministic per split.

    def _generate(self, count: int, first_seed: int, exclude: set[str]) -> dict[str, list]:
        rows = {"prompt": [], "puzzle": [], "board": [], "optimal_actions": [], "seed": []}
        seen = set(exclude)
        for seed in range(first_seed, first_seed + count * MAX_SEEDS_PER_PUZZLE):
            if len(rows["board"]) == count:
                break
            board = self.puzzle.generate(seed, self.difficulty)
            cell = self.puzzle.to_json(board)
            if cell in seen:
                continue
            seen.add(cell)
            solution = self.puzzle.solve(board)
            if solution is None:  # solvable by construction; a generator bug if not
                raise RuntimeError(f"The {self.name} generator made an unsolvable board from seed {seed}: {cell}")
            rows["prompt"].append(first_prompt(self.puzzle, board, self.num_turns))
            rows["puzzle"].append(self.name)
            rows["board"].append(cell)
            rows["optimal_actions"].append(len(solution))
            rows["seed"].append(seed)
        if len(rows["board"]) < count:
            raise ValueError(
                f"Only {len(rows['board'])} distinct {self.name} puzzles of {self.difficulty} in "
                f"{count * MAX_SEEDS_PER_PUZZLE} seeds, {count} wanted: lower `train_size`/`eval_size` or make the "
                "puzzles larger."
            )
        return rows

    def dataset(self, split: str = "train") -> Dataset:
        """Columns: `prompt` (the puzzle, as chat), `puzzle` (its name), `board` (the initial board, JSON),
        `optimal_actions` (the solver's optimum) and `seed` (the generator's). Train and eval come from disjoint seed
        ranges; an eval board never repeats a train board."""
        if split not in ("train", "eval"):
            raise ValueError(f"`split` must be 'train' or 'eval', got {split!r}.")
        if "train" not in self._rows:
            self._rows["train"] = self._generate(self.train_size, TRAIN_SEED, set())
        if split == "eval" and "eval" not in self._rows:
            self._rows["eval"] = self._generate(self.eval_size, EVAL_SEED, set(self._rows["train"]["board"]))
        return Dataset.from_dict(self._rows[split])

    # The environment.

    def reset(self, example: dict) -> PuzzleState:
        if example.get("puzzle") != self.name:
            raise ValueError(f"Task {self.name} got a row of puzzle {example.get('puzzle')!r}.")
        return initial_state(self.name, example["board"], example.get("optimal_actions"))

    def step(self, state: PuzzleState, agent: str, action: str, turn: int) -> PuzzleState:
        """`tool`: run its program and score its proposal (the board does not change). Any other agent (`plan`, or a
        lone agent in a baseline) commits the actions of its answer."""
        if agent == TOOL:
            return propose(self.puzzle, state, action)
        return commit(self.puzzle, state, agent, action, last_turn=turn >= self.num_turns - 1)

    def success(self, example: dict, state: PuzzleState, completions: dict[str, str]) -> bool:
        return state.solved

    def transition(self, prompt, observations: dict, turn: int, state: PuzzleState | None = None, **kwargs):
        """The next turn's prompt, the same for both agents: the current board, what was committed, what the tool's
        program did; the episode ends once the puzzle is solved (or has failed)."""
        if state is None or state.solved or state.failed:
            return NextTurn(done=True)
        content = (
            f"{self.puzzle.describe(state.board)}\n\n"
            f"Turn {turn + 1} of {self.num_turns} is over. Actions committed so far: "
            f"{self.puzzle.format_actions(state.committed)} ({state.attempts} actions, {state.invalid} invalid); "
            f"team reward so far {state.total:.2f}.\n"
            f"{state.tool_report}\n"
            f"Continue from the board above: this is turn {turn + 2} of {self.num_turns}. Actions are read after the "
            f"last 'Answer:', for example '{self.puzzle.answer_example}'."
        )
        return [[{"role": "user", "content": content}]] * len(observations)


class PlanPathTask(PuzzleTask):
    """Plan-Path (AT-GRPO paper): `tool` writes a BFS program, `plan` commits U/D/L/R moves to reach the goal on a
    10x10 grid with walls; shaped team reward (step −0.01, invalid −0.1, +1 goal, +0.5 optimal, −1 failure)."""

    name = "plan_path"
    puzzle = PLAN_PATH
    difficulties = PATH_DIFFICULTIES


class SokobanTask(PuzzleTask):
    """Sokoban (AT-GRPO paper): `tool` writes a solver program, `plan` commits U/D/L/R moves that push every box onto
    a goal on a 6x6 map; shaped team reward (step −0.01, invalid −0.05, +1 solved, +0.5 optimal, −1 failure)."""

    name = "sokoban"
    puzzle = SOKOBAN
    difficulties = SOKOBAN_DIFFICULTIES


class SudokuTask(PuzzleTask):
    """Sudoku 4x4 (AT-GRPO paper): `tool` writes a solver program, `plan` commits 'row column digit' placements;
    shaped team reward (placement −0.01, invalid −0.1, +1 solved, +0.5 optimal, −1 failure)."""

    name = "sudoku"
    puzzle = SUDOKU
    difficulties = SUDOKU_DIFFICULTIES
