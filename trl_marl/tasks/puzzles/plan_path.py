"""Plan-Path: walk from the start to the goal on a grid with walls, in as few moves as possible.

Boards are generated from a seed (random walls at a given density, a start and a goal that breadth-first search
connects) and solved by breadth-first search. Actions are the moves U, D, L, R; a move into a wall or off the grid is
invalid. The progress potential is minus the walking (BFS) distance to the goal.
"""

from __future__ import annotations

import functools
import json
import random
from collections import deque
from dataclasses import dataclass

from .common import MOVES, Puzzle, Shaping, parse_moves

# The reference's PlanPathGridEnvState defaults (PettingLLMs, pettingllms/multi_agent_env/stateful/env_state.py:
# DEFAULT_R_STEP, _R_INVALID, _R_GOAL, _R_OPT, _R_FAIL); progress is ours: 0.1 per cell of walking distance (the
# reference shapes with λ=1 on the Manhattan distance, γ=0.99, which also rewards walking into dead ends).
PLAN_PATH_SHAPING = Shaping(
    step=-0.01, invalid=-0.1, progress=0.1, goal=1.0, optimal=0.5, failure=-1.0, no_proposal=-0.5
)
MAX_TRIES = 1000  # random grids tried per seed before giving up


@dataclass(frozen=True)
class PathBoard:
    """A grid of '.' (free) and '#' (wall) rows, the walker's position and the goal, as (row, column) from 0."""

    grid: tuple[str, ...]
    position: tuple[int, int]
    goal: tuple[int, int]


@dataclass(frozen=True)
class PathDifficulty:
    """Generator settings: grid size, the chance that a cell is a wall, and the least walking distance from start to
    goal."""

    rows: int = 10
    cols: int = 10
    wall_density: float = 0.22
    min_distance: int = 1

    def __post_init__(self):
        if not (isinstance(self.rows, int) and isinstance(self.cols, int) and self.rows * self.cols >= 2):
            raise ValueError(f"PathDifficulty needs at least 2 cells, got rows={self.rows!r}, cols={self.cols!r}.")
        if not 0.0 <= self.wall_density < 1.0:
            raise ValueError(f"PathDifficulty.wall_density must be in [0, 1), got {self.wall_density!r}.")
        if not isinstance(self.min_distance, int) or not 1 <= self.min_distance <= self.rows + self.cols - 2:
            raise ValueError(
                f"PathDifficulty.min_distance must be between 1 and rows + cols - 2 = {self.rows + self.cols - 2}, "
                f"got {self.min_distance!r}."
            )


# The paper's Plan-Path is a 10x10 grid (PettingLLMs README, "Plan-Path (10x10 grid)"); its wall density is the
# reference's `block_ratio` default (0.22). "easy" is ours, small enough for the CPU recipe.
PATH_DIFFICULTIES = {
    "paper": PathDifficulty(rows=10, cols=10, wall_density=0.22, min_distance=1),
    "easy": PathDifficulty(rows=4, cols=4, wall_density=0.2, min_distance=2),
}


def _free(grid: tuple[str, ...], cell: tuple[int, int]) -> bool:
    row, col = cell
    return 0 <= row < len(grid) and 0 <= col < len(grid[0]) and grid[row][col] != "#"


@functools.lru_cache(maxsize=4096)
def distances_to(grid: tuple[str, ...], goal: tuple[int, int]) -> dict[tuple[int, int], int]:
    """Walking distance from every cell that can reach `goal` (breadth-first search from the goal)."""
    distances = {goal: 0}
    queue = deque([goal])
    while queue:
        row, col = queue.popleft()
        for d_row, d_col in MOVES.values():
            neighbour = (row + d_row, col + d_col)
            if neighbour not in distances and _free(grid, neighbour):
                distances[neighbour] = distances[(row, col)] + 1
                queue.append(neighbour)
    return distances


class PlanPath(Puzzle):
    name = "plan_path"
    shaping = PLAN_PATH_SHAPING
    answer_example = "Answer: R R D"

    def parse(self, text: str, board: PathBoard | None = None) -> list[str]:
        return parse_moves(text)

    def act(self, board: PathBoard, action: str) -> tuple[PathBoard, bool]:
        d_row, d_col = MOVES[action]
        target = (board.position[0] + d_row, board.position[1] + d_col)
        if not _free(board.grid, target):
            return board, False
        return PathBoard(board.grid, target, board.goal), True

    def potential(self, board: PathBoard) -> float:
        return -float(distances_to(board.grid, board.goal)[board.position])

    def is_solved(self, board: PathBoard) -> bool:
        return board.position == board.goal

    def render(self, board: PathBoard) -> str:
        rows = [list(row) for row in board.grid]
        rows[board.goal[0]][board.goal[1]] = "G"
        rows[board.position[0]][board.position[1]] = "@"
        return "\n".join("".join(row) for row in rows)

    def describe(self, board: PathBoard) -> str:
        (row, col), (goal_row, goal_col) = board.position, board.goal
        return (
            "Plan-Path: walk from @ to G in as few moves as possible.\n"
            "'.' is free, '#' is a wall, '@' is you, 'G' is the goal. Rows and columns count from 0 at the top left.\n"
            f"\n{self.render(board)}\n\n"
            f"You are at row {row}, column {col}; the goal is at row {goal_row}, column {goal_col}.\n"
            "Moves: U (up), D (down), L (left), R (right), as capital letters. A move into a wall or off the grid "
            "is invalid: you stay where you are, and it costs more than a step."
        )

    def solve(self, board: PathBoard) -> list[str] | None:
        distances = distances_to(board.grid, board.goal)
        if board.position not in distances:
            return None
        path, current = [], board.position
        while current != board.goal:
            for move, (d_row, d_col) in MOVES.items():  # first move (U, D, L, R order) that gets one step closer
                neighbour = (current[0] + d_row, current[1] + d_col)
                if distances.get(neighbour) == distances[current] - 1:
                    path.append(move)
                    current = neighbour
                    break
        return path

    def generate(self, seed: int, difficulty: PathDifficulty) -> PathBoard:
        rng = random.Random(seed)
        for _ in range(MAX_TRIES):
            grid = tuple(
                "".join("#" if rng.random() < difficulty.wall_density else "." for _ in range(difficulty.cols))
                for _ in range(difficulty.rows)
            )
            free = [(r, c) for r in range(difficulty.rows) for c in range(difficulty.cols) if grid[r][c] == "."]
            if len(free) < 2:
                continue
            start, goal = rng.sample(free, 2)
            distance = distances_to(grid, goal).get(start)
            if distance is not None and distance >= difficulty.min_distance:
                return PathBoard(grid, start, goal)
        raise ValueError(
            f"No Plan-Path board for {difficulty} after {MAX_TRIES} random grids (seed {seed}): lower `wall_density` "
            "or `min_distance`."
        )

    def to_json(self, board: PathBoard) -> str:
        return json.dumps({"grid": list(board.grid), "position": list(board.position), "goal": list(board.goal)})

    def from_json(self, cell: str) -> PathBoard:
        data = json.loads(cell)
        return PathBoard(tuple(data["grid"]), tuple(data["position"]), tuple(data["goal"]))


PLAN_PATH = PlanPath()
