"""What the three planning puzzles share: the shaped reward of a list of actions, answer parsing, the episode state.

A puzzle (`Puzzle`) is a pure environment on immutable boards: it parses actions from text, applies one action
(`act`), says whether a board is solved and how far along it is (`potential`), draws it, solves it, and generates
boards from a seed. `play` turns a list of actions into an `Outcome` with the shaped reward every puzzle uses:

    reward = Σ_actions (shaping.step if valid else shaping.invalid)
             + shaping.progress · (potential(after) − potential(before))
             + shaping.goal                        if the board is solved
             + shaping.optimal                     if solved with exactly the optimal number of actions in the episode

An invalid action leaves the board as it was and still counts as an attempt. Actions after the board is solved are
not played (nothing is played on a board that is already solved: reward 0). An answer with no action counts as one
invalid action. The potential term telescopes, so progress cannot
be farmed by moving back and forth.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

TOOL, PLAN = "tool", "plan"  # the two agents of every puzzle task
ANSWER_MARKER = re.compile(r"answer\s*:", re.IGNORECASE)  # actions are read after its last occurrence
MAX_ACTIONS = 100  # actions read from one answer at most; ours: bounds the work of one step, longer than any solution
MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
_MOVE_TOKEN = re.compile(r"\b[UDLR]+\b")  # capital letters only: "R", "RRDD", ["U", "R"]; prose words never match


@dataclass(frozen=True)
class Shaping:
    """The reward constants of one puzzle (see the module docstring for how they combine)."""

    step: float  # each valid action
    invalid: float  # each invalid action; an answer with no action counts as one
    progress: float  # per unit of potential gained (potential-based shaping, γ = 1)
    goal: float  # the board is solved
    optimal: float  # solved with exactly the optimal number of actions over the whole episode
    failure: float  # the turn limit was reached unsolved (added once, after the last turn's commit)
    no_proposal: float  # local reward of an agent that proposed no action (the tool: a crash, a timeout, no output)


@dataclass(frozen=True)
class Outcome:
    """What playing a list of actions from a board did."""

    board: Any  # the board afterwards
    reward: float  # the shaped reward of these actions
    valid: int  # actions that changed the board
    invalid: int  # actions that could not be made (an empty answer counts as one)
    solved: bool  # the board afterwards is solved
    played: tuple = ()  # the actions played (after truncation to MAX_ACTIONS, up to the one that solved the board)


class Puzzle(ABC):
    """A pure puzzle environment on immutable, hashable boards (dataclasses with `frozen=True`)."""

    name: str
    shaping: Shaping
    answer_example: str  # an example answer line, for prompts

    @abstractmethod
    def parse(self, text: str, board: Any) -> list:
        """The actions in `text` (an agent's answer or a program's output), in order, read after the last
        "Answer:" when there is one."""

    @abstractmethod
    def act(self, board: Any, action: Any) -> tuple[Any, bool]:
        """`(board after, True)` for a valid action; `(board, False)` for an invalid one (the board is unchanged)."""

    @abstractmethod
    def potential(self, board: Any) -> float:
        """How far along the board is (higher is closer to solved); its change is the progress term."""

    @abstractmethod
    def is_solved(self, board: Any) -> bool: ...

    @abstractmethod
    def render(self, board: Any) -> str:
        """The board as text (what the agents see and the tool's program reads on standard input)."""

    @abstractmethod
    def describe(self, board: Any) -> str:
        """The rules and the board, for a prompt."""

    @abstractmethod
    def solve(self, board: Any) -> list | None:
        """An optimal list of actions that solves `board`, or None when it has no solution."""

    @abstractmethod
    def generate(self, seed: int, difficulty: Any) -> Any:
        """A solvable, unsolved board generated from `seed` alone (the same seed gives the same board)."""

    @abstractmethod
    def to_json(self, board: Any) -> str: ...

    @abstractmethod
    def from_json(self, cell: str) -> Any: ...

    def format_actions(self, actions: list | tuple) -> str:
        return " ".join(str(action) for action in actions) or "(none)"


def answer_section(text: str) -> str:
    """The part of `text` after its last "Answer:" (any case), or all of it when there is none."""
    matches = list(ANSWER_MARKER.finditer(text))
    return text[matches[-1].end() :] if matches else text


def parse_moves(text: str) -> list[str]:
    """U/D/L/R moves in the answer section of `text`: capital letters standing alone or in runs ("R R D", "RRD",
    '["R", "D"]'); at most `MAX_ACTIONS`."""
    moves = [move for token in _MOVE_TOKEN.findall(answer_section(text)) for move in token]
    return moves[:MAX_ACTIONS]


def play(puzzle: Puzzle, board: Any, actions: list, attempts_before: int, optimum: int) -> Outcome:
    """Play `actions` from `board` with the shaped reward of the module docstring. `attempts_before`: actions already
    committed in this episode; `optimum`: the optimal number of actions for the episode's initial board."""
    shaping = puzzle.shaping
    if puzzle.is_solved(board):
        return Outcome(board, 0.0, 0, 0, True)
    if not actions:
        return Outcome(board, shaping.invalid, 0, 1, False)
    start_potential = puzzle.potential(board)
    reward, valid, invalid, played = 0.0, 0, 0, []
    for action in actions[:MAX_ACTIONS]:
        if puzzle.is_solved(board):
            break
        board, ok = puzzle.act(board, action)
        played.append(action)
        if ok:
            reward, valid = reward + shaping.step, valid + 1
        else:
            reward, invalid = reward + shaping.invalid, invalid + 1
    reward += shaping.progress * (puzzle.potential(board) - start_potential)
    solved = puzzle.is_solved(board)
    if solved:
        reward += shaping.goal
        if attempts_before + valid + invalid == optimum:
            reward += shaping.optimal
    return Outcome(board, reward, valid, invalid, solved, tuple(played))


@dataclass(frozen=True)
class Proposal:
    """The acting agent's last proposal: its actions (None: it proposed nothing), how it was obtained, and its local
    reward (the shaped reward of playing it from the state the agent saw, or `shaping.no_proposal`)."""

    agent: str
    actions: tuple | None
    status: str  # the tool: "ok", "no_actions", "syntax_error" or the sandbox status ("timeout", "error", ...);
    # the plan: "committed"
    output: str  # the tool's program output (truncated), for the next prompt
    reward: float


@dataclass
class PuzzleState:
    """One episode of a puzzle task: deep-copyable and picklable (every AT-GRPO branch holds its own copy)."""

    puzzle: str  # the puzzle's name
    board: Any  # the current board (immutable)
    optimum: int  # the optimal number of actions from the initial board
    attempts: int = 0  # actions committed so far, invalid ones included
    invalid: int = 0  # invalid actions committed so far
    total: float = 0.0  # the team's shaped return so far (the team reward)
    solved: bool = False
    failed: bool = False  # the turn limit was reached unsolved
    committed: list = field(default_factory=list)  # the actions committed so far
    proposal: Proposal | None = None  # the last proposal (by the agent that acted last)
    tool_report: str = ""  # what the tool's program did at the last turn, for the next prompt
