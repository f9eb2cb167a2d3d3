"""Sudoku (4x4 by default, 9x9 too): fill the empty cells so that every row, column and box holds each digit once.

Boards are generated from a seed: a solved grid (a pattern shuffled by digit, row, column, band and stack
permutations and a transposition), then cells are emptied in random order as long as the solution stays unique
(checked by the backtracking solver). Actions are placements (row, column, digit), rows and columns numbered from 1.
A placement is invalid when it is out of range, on a given cell, or repeats the digit in its row, column or box; a
placement may overwrite the team's own earlier placement. The progress potential is the number of non-given cells
that hold the solution's digit.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass

from .common import MAX_ACTIONS, Puzzle, Shaping, answer_section

# Ours, on the Plan-Path scale (the reference's Sudoku reward is 1 when solved, else 0): a step per placement, an
# invalid placement −0.1, +0.1 per cell that gains the solution's digit, +1 solved, +0.5 solved without a wasted
# placement, −1 at the turn limit unsolved.
SUDOKU_SHAPING = Shaping(step=-0.01, invalid=-0.1, progress=0.1, goal=1.0, optimal=0.5, failure=-1.0, no_proposal=-0.5)
MAX_TRIES = 100  # solved grids tried per seed before giving up
_GRID = re.compile(r"\[\s*\[(.*?)\]\s*\]", re.DOTALL)  # a whole grid written as nested lists: [[1,2,3,4], ...]


@dataclass(frozen=True)
class SudokuBoard:
    """`cells[r][c]` is 0 when empty; `givens[r][c]` marks the puzzle's fixed digits; `solution` is the unique
    solution (used for the progress potential, never shown to the agents)."""

    cells: tuple[tuple[int, ...], ...]
    givens: tuple[tuple[bool, ...], ...]
    solution: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.cells)


@dataclass(frozen=True)
class SudokuDifficulty:
    """Generator settings: the grid's side (4 or 9) and how many cells are empty."""

    size: int = 4
    blanks: int = 8

    def __post_init__(self):
        if self.size not in (4, 9):
            raise ValueError(f"SudokuDifficulty.size must be 4 or 9, got {self.size!r}.")
        if not isinstance(self.blanks, int) or not 1 <= self.blanks < self.size * self.size:
            raise ValueError(
                f"SudokuDifficulty.blanks must be between 1 and {self.size * self.size - 1}, got {self.blanks!r}."
            )


# The paper's Sudoku is 4x4 (PettingLLMs README, "Sudoku (4x4)"); the reference reads pre-generated puzzles whose
# number of blanks it does not state, so "paper" empties half the cells (ours). "easy" is ours.
SUDOKU_DIFFICULTIES = {
    "paper": SudokuDifficulty(size=4, blanks=8),
    "easy": SudokuDifficulty(size=4, blanks=4),
}


def conflicts(cells, row: int, col: int, digit: int) -> bool:
    """Whether `digit` at (row, col) (0-based) repeats a digit of its row, column or box, the cell itself aside."""
    size = len(cells)
    box = math.isqrt(size)
    top, left = row - row % box, col - col % box
    peers = {(row, c) for c in range(size)} | {(r, col) for r in range(size)}
    peers |= {(r, c) for r in range(top, top + box) for c in range(left, left + box)}
    return any(cells[r][c] == digit for r, c in peers if (r, c) != (row, col))


def count_solutions(cells, limit: int = 2) -> int:
    """Solutions of a (possibly partial) grid, counted up to `limit` (backtracking on the cell with the fewest
    candidates, with each row's, column's and box's digits kept as sets); 0 when the given digits already clash."""
    size = len(cells)
    box = math.isqrt(size)
    rows, cols, boxes = [set() for _ in range(size)], [set() for _ in range(size)], [set() for _ in range(size)]
    empty = []
    for r in range(size):
        for c in range(size):
            digit, b = cells[r][c], (r // box) * box + c // box
            if not digit:
                empty.append((r, c, b))
                continue
            if digit in rows[r] or digit in cols[c] or digit in boxes[b]:
                return 0
            rows[r].add(digit), cols[c].add(digit), boxes[b].add(digit)
    digits = set(range(1, size + 1))

    def search(open_cells: list) -> int:
        if not open_cells:
            return 1
        options = [(digits - rows[r] - cols[c] - boxes[b], (r, c, b)) for r, c, b in open_cells]
        candidates, cell = min(options, key=lambda option: len(option[0]))
        r, c, b = cell
        rest = [other for other in open_cells if other != cell]
        found = 0
        for digit in sorted(candidates):
            rows[r].add(digit), cols[c].add(digit), boxes[b].add(digit)
            found += search(rest)
            rows[r].discard(digit), cols[c].discard(digit), boxes[b].discard(digit)
            if found >= limit:
                break
        return found

    return search(empty)


class Sudoku(Puzzle):
    name = "sudoku"
    shaping = SUDOKU_SHAPING
    answer_example = "Answer: 1 3 2; 2 4 1"

    def parse(self, text: str, board: SudokuBoard) -> list[tuple[int, int, int]]:
        """Placements "row column digit" (any separators: "1 3 2", "(1, 3, 2)", "[[1,3,2],[2,4,1]]"), read as
        consecutive triples of whole numbers; or a whole grid ("[[1,2,3,4],...]", size x size numbers), read as one
        placement per cell that differs from the board, in reading order."""
        section = answer_section(text)
        grid = _GRID.search(section)
        if grid is not None:
            numbers = [int(n) for n in re.findall(r"\d+", grid.group(1))]
            if len(numbers) == board.size * board.size:
                return [
                    (r + 1, c + 1, numbers[r * board.size + c])
                    for r in range(board.size)
                    for c in range(board.size)
                    if numbers[r * board.size + c] != board.cells[r][c]
                ][:MAX_ACTIONS]
        numbers = [int(n) for n in re.findall(r"\d+", section)]
        return [tuple(numbers[i : i + 3]) for i in range(0, len(numbers) - 2, 3)][:MAX_ACTIONS]

    def act(self, board: SudokuBoard, action: tuple[int, int, int]) -> tuple[SudokuBoard, bool]:
        row, col, digit = action
        size = board.size
        if not (1 <= row <= size and 1 <= col <= size and 1 <= digit <= size):
            return board, False
        r, c = row - 1, col - 1
        if board.givens[r][c] or conflicts(board.cells, r, c, digit):
            return board, False
        cells = tuple(
            tuple(digit if (i, j) == (r, c) else value for j, value in enumerate(line))
            for i, line in enumerate(board.cells)
        )
        return SudokuBoard(cells, board.givens, board.solution), True

    def potential(self, board: SudokuBoard) -> float:
        return float(
            sum(
                board.cells[r][c] == board.solution[r][c]
                for r in range(board.size)
                for c in range(board.size)
                if not board.givens[r][c]
            )
        )

    def is_solved(self, board: SudokuBoard) -> bool:
        return board.cells == board.solution

    def render(self, board: SudokuBoard) -> str:
        return "\n".join(" ".join(str(value) if value else "." for value in line) for line in board.cells)

    def describe(self, board: SudokuBoard) -> str:
        size, box = board.size, math.isqrt(board.size)
        empty = sum(value == 0 for line in board.cells for value in line)
        return (
            f"Sudoku {size}x{size}: fill the empty cells ('.') with digits 1-{size} so that every row, every column "
            f"and every {box}x{box} box holds each digit once.\n"
            f"\n{self.render(board)}\n\n"
            f"Empty cells: {empty}. A placement is 'row column digit', rows and columns numbered 1-{size} from the "
            "top left: '1 3 2' puts 2 in row 1, column 3. Given digits cannot change; a placement that repeats a "
            "digit in its row, column or box is invalid and costs more than a step. You may instead give the whole "
            f"solved grid as [[...], ...] ({size} rows of {size} digits)."
        )

    def solve(self, board: SudokuBoard) -> list[tuple[int, int, int]] | None:
        """The placements that fill the empty cells with the solution, when the board has exactly one solution."""
        if count_solutions(board.cells) != 1:
            return None
        return [
            (r + 1, c + 1, board.solution[r][c])
            for r in range(board.size)
            for c in range(board.size)
            if board.cells[r][c] != board.solution[r][c]
        ]

    def generate(self, seed: int, difficulty: SudokuDifficulty) -> SudokuBoard:
        rng = random.Random(seed)
        size = difficulty.size
        for _ in range(MAX_TRIES):
            solution = _solved_grid(rng, size)
            cells = [list(line) for line in solution]
            order = [(r, c) for r in range(size) for c in range(size)]
            rng.shuffle(order)
            emptied = 0
            for r, c in order:
                if emptied == difficulty.blanks:
                    break
                cells[r][c] = 0
                if count_solutions(cells) == 1:
                    emptied += 1
                else:
                    cells[r][c] = solution[r][c]
            if emptied == difficulty.blanks:
                frozen = tuple(tuple(line) for line in cells)
                givens = tuple(tuple(value != 0 for value in line) for line in frozen)
                return SudokuBoard(frozen, givens, solution)
        raise ValueError(
            f"No Sudoku with a unique solution and {difficulty.blanks} blanks after {MAX_TRIES} grids (seed {seed}): "
            "lower `blanks`."
        )

    def format_actions(self, actions: list | tuple) -> str:
        return "; ".join(" ".join(str(n) for n in action) for action in actions) or "(none)"

    def to_json(self, board: SudokuBoard) -> str:
        return json.dumps({"cells": board.cells, "givens": board.givens, "solution": board.solution})

    def from_json(self, cell: str) -> SudokuBoard:
        data = json.loads(cell)
        as_tuples = lambda rows: tuple(tuple(row) for row in rows)  # noqa: E731
        return SudokuBoard(as_tuples(data["cells"]), as_tuples(data["givens"]), as_tuples(data["solution"]))


def from_rows(rows: list[str], solution: list[str] | None = None) -> SudokuBoard:
    """A board from text rows ("1 . . 4"; '.' or 0 is empty) whose non-empty cells are the givens; the solution is
    solved for when not given. Raises ValueError when the puzzle has no unique solution."""
    cells = tuple(tuple(0 if token in (".", "0") else int(token) for token in row.split()) for row in rows)
    if solution is None:
        if count_solutions(cells) != 1:
            raise ValueError(f"The Sudoku {rows!r} does not have exactly one solution.")
        solved = [list(line) for line in cells]
        _fill(solved)
        solution_cells = tuple(tuple(line) for line in solved)
    else:
        solution_cells = tuple(tuple(int(token) for token in row.split()) for row in solution)
    givens = tuple(tuple(value != 0 for value in line) for line in cells)
    return SudokuBoard(cells, givens, solution_cells)


def _fill(grid: list[list[int]]) -> bool:
    size = len(grid)
    for r in range(size):
        for c in range(size):
            if grid[r][c] == 0:
                for digit in range(1, size + 1):
                    if not conflicts(grid, r, c, digit):
                        grid[r][c] = digit
                        if _fill(grid):
                            return True
                grid[r][c] = 0
                return False
    return True


def _solved_grid(rng: random.Random, size: int) -> tuple[tuple[int, ...], ...]:
    """A random solved grid: the pattern (box·(r mod box) + r div box + c) mod size, shuffled by digits, rows within
    bands, bands, columns within stacks and stacks, and transposed with chance 1/2."""
    box = math.isqrt(size)
    digits = list(range(1, size + 1))
    rng.shuffle(digits)

    def shuffled_lines() -> list[int]:
        bands = list(range(box))
        rng.shuffle(bands)
        lines = []
        for band in bands:
            inner = list(range(box))
            rng.shuffle(inner)
            lines += [band * box + i for i in inner]
        return lines

    rows, cols = shuffled_lines(), shuffled_lines()
    grid = [[digits[(box * (r % box) + r // box + c) % size] for c in cols] for r in rows]
    if rng.random() < 0.5:
        grid = [list(line) for line in zip(*grid)]
    return tuple(tuple(line) for line in grid)


SUDOKU = Sudoku()
