"""The planning puzzles (plan_path, sokoban, sudoku): transitions and shaped rewards on hand-made boards, equal to
hand-computed values; seeded generators (solvable, deterministic); the tool agent's program in the sandbox; an AT-GRPO
episode with scripted agents; training on a tiny model; the CPU recipe end to end on the real default model."""

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sandbox_helpers import require_bubblewrap
from test_trainer import lora_params, randomize_adapters
from tiny_run import TINY_RUN

from trl_marl import ATGRPOConfig, ATGRPOTrainer, NextTurn
from trl_marl.rollouts.atgrpo_rollout import ATGRPORollout
from trl_marl.rollouts.rollout import RolloutSettings
from trl_marl.rollouts.scheduling import sequential
from trl_marl.sandbox import Limits
from trl_marl.tasks import local_rewards, resolve_task
from trl_marl.tasks.puzzles import (
    PLAN,
    PLAN_PATH,
    SOKOBAN,
    SUDOKU,
    TOOL,
    PathBoard,
    PathDifficulty,
    PlanPathTask,
    SokobanDifficulty,
    SokobanTask,
    SudokuDifficulty,
    SudokuTask,
    count_solutions,
    from_rows,
    parse_map,
    parse_moves,
    plan_proposal_reward,
    play,
    puzzle_reward,
    tool_proposal_reward,
)
from trl_marl.tasks.puzzles import tool_and_plan as puzzle_tasks

REPO = Path(__file__).resolve().parents[1]

# A 3x4 Plan-Path board: start (0, 0), goal (2, 3), walls at (1, 1) and (1, 2); the shortest walk is 5 moves.
#   @...
#   .##.
#   ...G
PATH_GRID = ("....", ".##.", "....")


def path_board(position=(0, 0)):
    return PathBoard(PATH_GRID, position, (2, 3))


def path_row(optimal_actions=5):
    board = PLAN_PATH.to_json(path_board())
    return {"prompt": [{"role": "user", "content": "walk"}], "puzzle": "plan_path", "board": board,
            "optimal_actions": optimal_actions}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "text, moves",
    [
        ("Answer: R R D", ["R", "R", "D"]),
        ('Answer: ["U", "L"]', ["U", "L"]),
        ("Answer: RRD", ["R", "R", "D"]),
        ("First I go R, then... Answer: D", ["D"]),  # only after the last "Answer:"
        ("I go Right and then Down", []),  # words are not moves: capital letters only
        ("answer: rrd", []),
    ],
)
def test_moves_are_read_after_the_last_answer_marker(text, moves):
    assert parse_moves(text) == moves


def test_sudoku_answers_are_placements_or_a_whole_grid():
    board = from_rows(["1 . 3 4", "3 4 1 2", "2 1 . 3", "4 3 2 1"])
    assert SUDOKU.parse("Answer: 1 2 2; 3 3 4", board) == [(1, 2, 2), (3, 3, 4)]
    assert SUDOKU.parse("Answer: [[1, 2, 2], [3, 3, 4]]", board) == [(1, 2, 2), (3, 3, 4)]
    grid = "Answer: [[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]]"
    assert SUDOKU.parse(grid, board) == [(1, 2, 2), (3, 3, 4)]  # only the cells that differ from the board


# ---------------------------------------------------------------------------------------------------------- Plan-Path


def test_plan_path_optimal_walk_earns_steps_progress_goal_and_optimal_bonus():
    outcome = play(PLAN_PATH, path_board(), list("RRRDD"), attempts_before=0, optimum=5)
    # 5 steps × −0.01, progress 0.1 × (5 − 0) cells, +1 goal, +0.5 optimal
    assert outcome.reward == pytest.approx(-0.05 + 0.5 + 1.0 + 0.5)
    assert (outcome.valid, outcome.invalid, outcome.solved, outcome.board.position) == (5, 0, True, (2, 3))


def test_plan_path_invalid_moves_cost_more_and_leave_the_walker_in_place():
    into_wall = play(PLAN_PATH, path_board(), ["D", "R"], 0, 5)  # D to (1, 0); R into the wall at (1, 1)
    assert into_wall.reward == pytest.approx(-0.01 - 0.1 + 0.1 * (5 - 4))
    assert (into_wall.valid, into_wall.invalid, into_wall.board.position) == (1, 1, (1, 0))
    off_grid = play(PLAN_PATH, path_board(), ["U", "L"], 0, 5)
    assert off_grid.reward == pytest.approx(-0.2) and off_grid.board.position == (0, 0)


def test_plan_path_detour_reaches_the_goal_without_the_optimal_bonus():
    outcome = play(PLAN_PATH, path_board(), list("DURRRDD"), 0, 5)  # 7 valid moves, back to the start once
    assert outcome.reward == pytest.approx(-0.07 + 0.5 + 1.0)


def test_plan_path_moves_after_the_goal_are_not_played():
    outcome = play(PLAN_PATH, path_board(), list("RRRDDLL"), 0, 5)
    assert outcome.reward == pytest.approx(1.95) and outcome.played == tuple("RRRDD")
    assert play(PLAN_PATH, outcome.board, ["L"], 5, 5).reward == 0.0  # nothing is played on a solved board


def test_a_solution_split_over_two_turns_earns_what_it_earns_in_one():
    task = PlanPathTask(num_turns=2)
    state = task.reset(path_row())
    state = task.step(state, PLAN, "Answer: R R", turn=0)
    assert state.total == pytest.approx(-0.02 + 0.2) and not state.solved
    assert task.transition(prompt=None, observations={TOOL: None, PLAN: None}, turn=0, state=state)[0][0]["content"]
    state = task.step(state, PLAN, "I continue. Answer: R D D", turn=1)
    assert state.total == pytest.approx(1.95)  # the optimal bonus counts the episode's moves: 2 + 3 = 5
    assert state.solved and task.success(path_row(), state, {}) is True
    assert task.transition(prompt=None, observations={}, turn=1, state=state) == NextTurn(done=True)


def test_an_episode_unsolved_at_the_turn_limit_fails_with_minus_one():
    task = PlanPathTask(num_turns=2)
    state = task.step(task.reset(path_row()), PLAN, "Answer: R", turn=0)
    state = task.step(state, PLAN, "Answer: U", turn=1)  # off the grid, at the last turn
    assert state.total == pytest.approx((-0.01 + 0.1) - 0.1 - 1.0)
    assert state.failed and not task.success(path_row(), state, {})
    assert (state.attempts, state.invalid, state.committed) == (2, 1, ["R", "U"])


def test_an_answer_without_actions_is_one_invalid_action_and_a_poor_proposal():
    task = PlanPathTask()
    state = task.step(task.reset(path_row()), PLAN, "I am not sure where to go.", turn=0)
    assert state.total == pytest.approx(-0.1) and (state.attempts, state.invalid) == (1, 1)
    assert state.proposal.actions is None and state.proposal.reward == -0.5


def test_the_state_is_deep_copyable_and_picklable():
    task = PlanPathTask()
    state = task.step(task.reset(path_row()), PLAN, "Answer: D", turn=0)
    assert copy.deepcopy(state) == state and pickle.loads(pickle.dumps(state)) == state
    twin = copy.deepcopy(state)
    task.step(twin, PLAN, "Answer: D", turn=1)
    assert state.board.position == (1, 0) and twin.board.position == (2, 0)


def test_reset_depends_on_the_row_only_and_rejects_another_puzzles_row():
    task = PlanPathTask()
    assert task.reset(path_row()) == task.reset(path_row())
    with pytest.raises(ValueError, match="got a row of puzzle 'sudoku'"):
        task.reset({**path_row(), "puzzle": "sudoku"})


# ---------------------------------------------------------------------------------------------------------- Sokoban


def test_sokoban_push_onto_the_goal_solves_with_optimal_bonus():
    board = parse_map(["######", "#@$_.#", "#____#", "######"])  # box (1, 2), goal (1, 4)
    assert SOKOBAN.solve(board) == ["R", "R"]
    one = play(SOKOBAN, board, ["R"], 0, 2)
    assert one.reward == pytest.approx(-0.01 + 0.1) and one.board.boxes == {(1, 3)} and not one.solved
    both = play(SOKOBAN, board, ["R", "R"], 0, 2)
    assert both.reward == pytest.approx(-0.02 + 0.1 * 2 + 1.0 + 0.5) and both.solved


def test_sokoban_cannot_push_a_box_into_another_box_or_a_wall():
    two_boxes = parse_map(["#######", "#@$$._#", "#.____#", "#######"])
    blocked = play(SOKOBAN, two_boxes, ["R"], 0, 99)
    assert blocked.reward == pytest.approx(-0.05) and blocked.board == two_boxes
    walled = parse_map(["#####", "#_@$#", "#.__#", "#####"])  # the box has a wall behind it
    outcome = play(SOKOBAN, walled, ["R", "U", "D"], 0, 99)  # push into the wall, walk into the wall, step down
    assert outcome.reward == pytest.approx(-0.05 - 0.05 - 0.01)
    assert (outcome.valid, outcome.invalid, outcome.board.player, outcome.board.boxes) == (1, 2, (2, 2), {(1, 3)})
    assert SOKOBAN.solve(walled) is None  # a box in a corner off its goal is stuck


def test_sokoban_pushing_a_box_off_its_goal_loses_progress():
    board = parse_map(["######", "#@*__#", "#.$__#", "######"])  # one box on a goal, one next to the other goal
    outcome = play(SOKOBAN, board, ["R"], 0, 99)
    # Box distances to their nearest goals go from 0 + 1 to 1 + 1.
    assert outcome.reward == pytest.approx(-0.01 - 0.1)
    assert SOKOBAN.render(outcome.board).split("\n") == ["######", "#_+$_#", "#.$__#", "######"]


# ---------------------------------------------------------------------------------------------------------- Sudoku

SOLVED = ["1 2 3 4", "3 4 1 2", "2 1 4 3", "4 3 2 1"]


def test_sudoku_filling_the_blanks_solves_with_optimal_bonus():
    board = from_rows(["1 . 3 4", "3 4 1 2", "2 1 . 3", "4 3 2 1"])  # blanks (1, 2) = 2 and (3, 3) = 4
    assert board.solution == tuple(tuple(int(d) for d in row.split()) for row in SOLVED)
    outcome = play(SUDOKU, board, [(1, 2, 2), (3, 3, 4)], 0, 2)
    assert outcome.reward == pytest.approx(-0.02 + 0.1 * 2 + 1.0 + 0.5) and outcome.solved


@pytest.mark.parametrize(
    "rows, placement, why",
    [
        (["1 . 3 4", "3 4 1 2", "2 1 . 3", "4 3 2 1"], (1, 2, 3), "row conflict"),
        (["1 2 . .", "3 4 . .", ". . . .", ". . . ."], (3, 1, 1), "column conflict"),
        ([". . . .", ". 4 . .", ". . . .", ". . . ."], (1, 1, 4), "box conflict"),
        (["1 . 3 4", "3 4 1 2", "2 1 . 3", "4 3 2 1"], (1, 1, 1), "a given cell"),
        (["1 . 3 4", "3 4 1 2", "2 1 . 3", "4 3 2 1"], (5, 1, 1), "out of range"),
    ],
)
def test_sudoku_invalid_placements_cost_more_and_change_nothing(rows, placement, why):
    board = from_rows(rows, solution=SOLVED)
    outcome = play(SUDOKU, board, [placement], 0, 99)
    assert outcome.reward == pytest.approx(-0.1), why
    assert outcome.board == board and outcome.invalid == 1


def test_sudoku_own_placements_can_be_overwritten_and_progress_follows_the_solution():
    board = from_rows(["1 2 . .", "3 4 . .", ". . . .", ". . . ."], solution=SOLVED)
    assert count_solutions(board.cells) == 2  # a partial board for the transitions only
    wrong = play(SUDOKU, board, [(1, 3, 4)], 0, 99)  # consistent, but not the solution's digit
    assert wrong.reward == pytest.approx(-0.01) and wrong.board.cells[0][2] == 4
    fixed = play(SUDOKU, wrong.board, [(1, 3, 3)], 1, 99)
    assert fixed.reward == pytest.approx(-0.01 + 0.1) and fixed.board.cells[0][2] == 3
    broken = play(SUDOKU, fixed.board, [(1, 3, 4)], 2, 99)
    assert broken.reward == pytest.approx(-0.01 - 0.1)


# ---------------------------------------------------------------------------------------------------------- generators

GENERATORS = [
    (PLAN_PATH, PathDifficulty(rows=4, cols=4, wall_density=0.2, min_distance=2)),
    (PLAN_PATH, PathDifficulty()),
    (SOKOBAN, SokobanDifficulty(rows=5, cols=5, num_boxes=1, carve_steps=12, pull_steps=6, min_moves=1)),
    (SOKOBAN, SokobanDifficulty()),
    (SOKOBAN, SokobanDifficulty(rows=7, cols=7, num_boxes=2, carve_steps=40, pull_steps=60, min_moves=3)),
    (SUDOKU, SudokuDifficulty(size=4, blanks=4)),
    (SUDOKU, SudokuDifficulty(size=4, blanks=10)),
]


@pytest.mark.parametrize("puzzle, difficulty", GENERATORS, ids=lambda value: repr(value)[:60])
def test_generated_puzzles_are_solvable_unsolved_and_deterministic_per_seed(puzzle, difficulty):
    boards = [puzzle.generate(seed, difficulty) for seed in range(12)]
    assert boards[3] == puzzle.generate(3, difficulty)  # the same seed gives the same board
    assert len({puzzle.to_json(board) for board in boards}) >= 10  # other seeds give other boards
    for board in boards:
        assert not puzzle.is_solved(board)
        solution = puzzle.solve(board)
        outcome = play(puzzle, board, solution, 0, len(solution))
        assert outcome.solved and outcome.invalid == 0
        assert outcome.reward == pytest.approx(
            puzzle.shaping.step * len(solution)
            + puzzle.shaping.progress * (puzzle.potential(outcome.board) - puzzle.potential(board))
            + puzzle.shaping.goal
            + puzzle.shaping.optimal
        )
        assert puzzle.from_json(puzzle.to_json(board)) == board


def test_generators_respect_their_difficulty():
    path = PathDifficulty(rows=5, cols=7, wall_density=0.3, min_distance=4)
    for seed in range(10):
        board = PLAN_PATH.generate(seed, path)
        assert (len(board.grid), len(board.grid[0])) == (5, 7) and len(PLAN_PATH.solve(board)) >= 4
    boxes = SokobanDifficulty(rows=7, cols=7, num_boxes=2, carve_steps=40, pull_steps=60, min_moves=3)
    for seed in range(5):
        board = SOKOBAN.generate(seed, boxes)
        assert len(board.boxes) == 2 and len(board.goals) == 2 and len(SOKOBAN.solve(board)) >= 3
    for seed in range(5):
        board = SUDOKU.generate(seed, SudokuDifficulty(blanks=10))
        assert sum(value == 0 for row in board.cells for value in row) == 10
        assert count_solutions(board.cells) == 1


def test_bad_difficulties_name_the_bad_value():
    with pytest.raises(ValueError, match="wall_density must be in \\[0, 1\\), got 1.0"):
        PathDifficulty(wall_density=1.0)
    with pytest.raises(ValueError, match="blanks must be between 1 and 15, got 16"):
        SudokuDifficulty(blanks=16)
    with pytest.raises(ValueError, match="Unknown sokoban difficulty 'hard': choose one of \\['easy', 'paper'\\]"):
        SokobanTask(difficulty="hard")
    with pytest.raises(ValueError, match="`num_turns` must be a positive integer, got 0"):
        SudokuTask(num_turns=0)


@pytest.mark.parametrize("task_class", [PlanPathTask, SokobanTask, SudokuTask])
def test_datasets_are_deterministic_and_eval_never_repeats_a_train_board(task_class):
    train = task_class(difficulty="easy", train_size=20, eval_size=8).dataset("train")
    again = task_class(difficulty="easy", train_size=20, eval_size=8)
    assert train.to_dict() == again.dataset("train").to_dict()
    evaluation = again.dataset("eval")
    assert len(train) == 20 and len(evaluation) == 8
    assert not set(train["board"]) & set(evaluation["board"])
    assert max(train["seed"]) < min(evaluation["seed"])
    row = evaluation[0]
    assert row["puzzle"] == task_class.name and json.loads(row["board"])
    assert row["optimal_actions"] == len(again.puzzle.solve(again.reset(row).board))
    assert again.puzzle.render(again.reset(row).board) in row["prompt"][0]["content"]


def test_the_tasks_are_registered_plugins():
    assert isinstance(resolve_task("plan_path"), PlanPathTask)
    assert isinstance(resolve_task("sokoban", difficulty="easy"), SokobanTask)
    assert isinstance(resolve_task("sudoku"), SudokuTask)
    from trl_marl.registry import load_plugin

    assert load_plugin("rewards", "puzzle_reward") is puzzle_reward


def test_puzzle_reward_alone_plays_the_plan_answer_from_the_rows_board():
    rows = [path_row(), path_row()]
    completions = [{TOOL: "code", PLAN: "Answer: R R R D D"}, "Answer: U"]  # a team's answer, a lone agent's
    rewards = puzzle_reward(None, completions, puzzle=[r["puzzle"] for r in rows], board=[r["board"] for r in rows])
    assert rewards == pytest.approx([1.95, -0.1 - 1.0])  # a one-turn episode: unsolved fails


# ---------------------------------------------------------------------------------------------------------- the tool

BFS_PROGRAM = """Here is a breadth-first search.
```python
import sys
from collections import deque
rows = [line for line in sys.stdin.read().splitlines() if line]
cells = {(r, c): ch for r, line in enumerate(rows) for c, ch in enumerate(line)}
start = next(p for p, ch in cells.items() if ch == "@")
goal = next(p for p, ch in cells.items() if ch == "G")
paths, queue = {start: ""}, deque([start])
while queue:
    r, c = queue.popleft()
    for move, (dr, dc) in {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}.items():
        cell = (r + dr, c + dc)
        if cells.get(cell, "#") != "#" and cell not in paths:
            paths[cell] = paths[(r, c)] + move
            queue.append(cell)
print("Answer:", " ".join(paths[goal]))
```"""
CRASH = "```python\nraise RuntimeError('no idea')\n```"


def test_the_tool_program_runs_in_the_sandbox_and_its_proposal_is_simulated():
    require_bubblewrap()
    task = PlanPathTask()
    start = task.reset(path_row())
    state = task.step(copy.deepcopy(start), TOOL, BFS_PROGRAM, turn=0)
    assert state.proposal.status == "ok" and len(state.proposal.actions) == 5
    assert state.proposal.reward == pytest.approx(1.95)  # the simulated outcome of an optimal walk
    assert state.board == start.board and state.total == 0.0  # the tool's proposal does not move the walker
    assert "The tool agent's program printed" in state.tool_report
    assert tool_proposal_reward(None, [BFS_PROGRAM], state=[state]) == pytest.approx([1.95])


@pytest.mark.parametrize(
    "text, status",
    [
        (CRASH, "error"),
        ("```python\nwhile True:\n    pass\n```", "timeout"),
        ("```python\nprint('hello')\n```", "no_actions"),
        ("I would walk right, then down.", "syntax_error"),
    ],
)
def test_a_failing_tool_program_is_a_proposal_of_nothing(monkeypatch, text, status):
    require_bubblewrap()
    monkeypatch.setattr(puzzle_tasks, "TOOL_LIMITS", Limits(wall_time_s=1.0))
    task = PlanPathTask()
    state = task.step(task.reset(path_row()), TOOL, text, turn=0)
    assert (state.proposal.status, state.proposal.actions, state.proposal.reward) == (status, None, -0.5)


def test_without_the_state_local_rewards_judge_the_proposal_from_the_initial_board():
    require_bubblewrap()
    columns = {key: [path_row()[key]] * 2 for key in ("puzzle", "board", "optimal_actions")}
    assert tool_proposal_reward(None, [BFS_PROGRAM, CRASH], **columns) == pytest.approx([1.95, -0.5])
    assert plan_proposal_reward(None, ["Answer: D R", "nothing"], **columns) == pytest.approx([-0.01, -0.5])


# ---------------------------------------------------------------------------------------------------------- AT-GRPO


class Scripted:
    """`generate` stand-in: row r of agent a says `texts[a][r]`; records the model inputs."""

    def __init__(self, texts):
        self.texts, self.inputs = texts, []

    def __call__(self, model_inputs, agents):
        self.inputs.append(list(model_inputs))
        texts = [self.texts[agent][row % len(self.texts[agent])] for row, agent in enumerate(agents)]
        return [[1]] * len(texts), [[2]] * len(texts), texts


def test_an_at_grpo_episode_scores_groups_with_the_puzzle_rewards_and_stops_when_solved():
    require_bubblewrap()
    task = PlanPathTask(num_turns=2)
    names = [TOOL, PLAN]

    def score(joint_actions):
        team = puzzle_reward(None, [ja.completions for ja in joint_actions], state=[ja.state for ja in joint_actions])
        return torch.tensor(team).view(-1, 1)

    def local_score(agent, joint_actions):
        texts = [ja.completions[names[agent]] for ja in joint_actions]
        return local_rewards(task, names[agent], None, texts, state=[ja.state for ja in joint_actions])

    texts = {0: [BFS_PROGRAM, CRASH, "I would walk."], 1: ["Answer: R R R D D", "Answer: U", "No idea."]}
    generate = Scripted(texts)
    settings = RolloutSettings(
        agent_names=names, num_turns=2, reward_weights=torch.ones(1), baseline="mean", scale_rewards="group",
        transition=task.transition, agent_input=lambda agent, prompt: prompt, scheduler=sequential, reset=task.reset,
        step=task.step, success=task.success,
    )  # fmt: skip
    rollout = ATGRPORollout(settings, num_generations=3, team_reward_weight=1.0, continuation="greedy")
    result = rollout.run([path_row() for _ in range(3)], 0, generate, score, local_score)
    rewards = {agent: [ja.reward for ja in result.joint_actions if ja.node[2] == agent] for agent in (0, 1)}
    assert rewards[0] == pytest.approx([0.0 + 1.95, 0.0 - 0.5, 0.0 - 0.5])  # team (nothing committed) + simulated
    assert rewards[1] == pytest.approx([1.95 + 1.95, -0.1 - 0.1, -0.1 - 0.5])  # team + own commit
    assert 'print("Answer:"' in str(generate.inputs[1][0])  # the plan saw the chosen tool program
    assert result.metrics["episodes/success_rate"] == 1.0 and result.metrics["episodes/num_turns"] == 1.0


def length_bonus(prompts, completions, **kwargs):
    return [len(text) / 100 for text in completions]


class PlanPathWithLengthBonus(PlanPathTask):
    """A tiny random model never solves a puzzle: a small length bonus makes its candidates differ, so that both
    adapters get a gradient while the puzzle environment runs underneath."""

    local_reward_funcs = {TOOL: [tool_proposal_reward, length_bonus], PLAN: [plan_proposal_reward, length_bonus]}


def test_the_puzzle_task_trains_a_few_at_grpo_steps_on_a_tiny_model(tiny_model_dir, tmp_path):
    task = PlanPathWithLengthBonus(difficulty="easy", num_turns=2, train_size=8, eval_size=2)
    args = ATGRPOConfig.for_task(
        task, output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
        max_steps=2, **TINY_RUN, gradient_checkpointing=False, seed=3,
    )  # fmt: skip
    trainer = ATGRPOTrainer(tiny_model_dir, args=args, task=task)
    randomize_adapters(trainer)
    before = {name: lora_params(trainer.model, name) for name in (TOOL, PLAN)}
    trainer.train()
    for name, params in before.items():
        after = lora_params(trainer.model, name)
        assert any(not torch.equal(params[n], after[n]) for n in params), f"adapter {name} did not change"
    logged = trainer.state.log_history[0]
    assert 0.0 <= logged["episodes/success_rate"] <= 1.0 and 1.0 <= logged["episodes/num_turns"] <= 2.0
    assert 0.0 <= logged["puzzles/solved"] <= 1.0
    for agent in (TOOL, PLAN):  # one group per (puzzle, turn, agent), both agents scored with their local rewards
        assert f"turns/0/agents/{agent}/group_reward_std" in logged and f"agents/{agent}/local_reward" in logged


def test_the_single_agent_baseline_evaluates_on_the_puzzle(tiny_model_dir):
    from trl_marl.cli.evaluation import evaluate_task

    task = PlanPathTask(difficulty="easy", num_turns=2, train_size=4, eval_size=2)
    metrics = evaluate_task(task, "single", model=tiny_model_dir, limit=2, max_completion_length=8, use_cpu=True)
    assert 0.0 <= metrics["puzzles/solved"] <= 1.0 and metrics["reward"] <= 1.95


# ---------------------------------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("task", ["plan_path", "sokoban", "sudoku"])
def test_the_paper_configs_parse_with_the_papers_settings(task):
    from trl_marl.cli.train import parse_train_config

    path = str(REPO / "recipes" / "paper" / "atgrpo_puzzles.yaml")
    overrides = ["--task", task, "--output_dir", f"outputs/{task}", "--bf16", "false"]  # bf16 needs a GPU
    script_args, args = parse_train_config(path, overrides)
    assert (script_args.algorithm, script_args.task, script_args.load_in_4bit) == ("at_grpo", task, True)
    assert script_args.model_name_or_path == "Qwen/Qwen3-1.7B" and args.output_dir == f"outputs/{task}"
    assert (args.num_generations, args.num_turns, args.team_reward_weight) == (4, 4, 1.0)
    assert args.agent_names == [TOOL, PLAN] and args.scheduler == "sequential"
    assert args.learning_rate == 1e-6 and args.temperature == 1.0 and args.top_p == 1.0 and args.beta == 0.0
    # A micro-batch holds one copy's candidates: 1 x 2 agents x 4 turns = 8 rows; 8 copies (2 puzzles) per step.
    assert (args.per_device_train_batch_size, args.steps_per_generation) == (1, 8)


def run_recipe(output_dir, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "recipes" / "atgrpo_puzzles.py"), "--output_dir", str(output_dir),
               "--max_steps", "2", "--logging_steps", "1", "--eval_puzzles", "1", "--max_completion_length", "16",
               "--num_turns", "1", *flags]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)


# The recipe runs (~75 s each) are slow tests; the default run trains the puzzle tasks with AT-GRPO on a tiny model
# (test_the_puzzle_task_trains_a_few_at_grpo_steps_on_a_tiny_model).
RECIPE_TASKS = [
    pytest.param("plan_path", marks=pytest.mark.slow),
    pytest.param("sokoban", marks=pytest.mark.slow),
    pytest.param("sudoku", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("task", RECIPE_TASKS)
def test_the_cpu_recipe_trains_and_reports_the_success_rate(tmp_path, default_model_dir, task):
    require_bubblewrap()
    result = run_recipe(tmp_path, "--task", task)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["task"] == task and results["steps"] == 2
    for figures in (results["before"], results["after"]):
        assert 0.0 <= figures["success_rate"] <= 1.0 and figures["turns"] == 1.0
        assert figures["team_reward"] <= 2.0 and figures["final_team_reward"] <= 2.0
    assert (tmp_path / "tool" / "adapter_config.json").is_file() and (tmp_path / "plan").is_dir()
    assert "Before training:" in result.stdout and "After 2 steps:" in result.stdout
