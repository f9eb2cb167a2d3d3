"""The AT-GRPO paper's planning puzzles (arXiv 2510.11062): Plan-Path, Sokoban and Sudoku, as pure environments
(`plan_path`, `sokoban`, `sudoku` modules: boards, actions, shaped rewards, solvers, seeded generators) and as tasks
played by a `tool` agent and a `plan` agent (`tool_and_plan`). See docs/atgrpo_puzzles.md."""

from .common import PLAN, TOOL, Outcome, Proposal, Puzzle, PuzzleState, Shaping, answer_section, parse_moves, play
from .plan_path import PATH_DIFFICULTIES, PLAN_PATH, PathBoard, PathDifficulty
from .sokoban import SOKOBAN, SOKOBAN_DIFFICULTIES, SokobanBoard, SokobanDifficulty, parse_map
from .sudoku import SUDOKU, SUDOKU_DIFFICULTIES, SudokuBoard, SudokuDifficulty, count_solutions, from_rows
from .tool_and_plan import (
    PUZZLES,
    PlanPathTask,
    PuzzleTask,
    SokobanTask,
    SudokuTask,
    plan_proposal_reward,
    puzzle_reward,
    run_tool,
    tool_proposal_reward,
)

__all__ = [
    "PATH_DIFFICULTIES",
    "PLAN",
    "PLAN_PATH",
    "PUZZLES",
    "SOKOBAN",
    "SOKOBAN_DIFFICULTIES",
    "SUDOKU",
    "SUDOKU_DIFFICULTIES",
    "TOOL",
    "Outcome",
    "PathBoard",
    "PathDifficulty",
    "PlanPathTask",
    "Proposal",
    "Puzzle",
    "PuzzleState",
    "PuzzleTask",
    "Shaping",
    "SokobanBoard",
    "SokobanDifficulty",
    "SokobanTask",
    "SudokuBoard",
    "SudokuDifficulty",
    "SudokuTask",
    "answer_section",
    "count_solutions",
    "from_rows",
    "parse_map",
    "parse_moves",
    "plan_proposal_reward",
    "play",
    "puzzle_reward",
    "run_tool",
    "tool_proposal_reward",
]
