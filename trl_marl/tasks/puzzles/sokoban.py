"""Sokoban: push every box onto a goal on a small walled map.

Boards are generated from a seed: a room is carved by a random walk inside the border walls, the boxes are put on
goals, and the player pulls them away by playing the game backwards (every pull reversed is a legal push, so the
board is solvable by construction; the breadth-first solver checks it and gives the optimal number of moves).
Actions are the moves U, D, L, R; walking into a box pushes it when the cell behind it is free. A move into a wall,
or a push into a wall or another box, is invalid. The progress potential is minus the summed Manhattan distance of
each box to its nearest goal.
"""

from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import dataclass

from .common import MOVES, Puzzle, Shaping, parse_moves

# step and invalid: the reference's SokobanGridEnvState (PettingLLMs, pettingllms/multi_agent_env/stateful/
# env_state.py: DEFAULT_R_STEP −0.01, DEFAULT_R_INVALID −0.05), progress its shaping coefficient (DEFAULT_LAMBDA_POT
# 0.1, here with γ = 1 so that it telescopes). goal, optimal and failure are the shape on the Plan-Path scale
# (the reference's Sokoban uses +10 to win, −5 to fail, ±1/−0.5 per box on/off a goal, and no optimal bonus).
SOKOBAN_SHAPING = Shaping(
    step=-0.01, invalid=-0.05, progress=0.1, goal=1.0, optimal=0.5, failure=-1.0, no_proposal=-0.5
)
MAX_TRIES = 200  # random rooms tried per seed before giving up
MAX_SOLVER_STATES = 200_000  # (player, boxes) states the breadth-first solver visits at most
CHANGE_DIRECTION = 0.35  # the room-carving walk turns with this chance (the reference's p_change_directions)
PULL_CHANCE = 0.5  # ours: when a box is behind the player in the backward game, it is pulled with this chance

FLOOR, WALL, GOAL, BOX, BOX_ON_GOAL, PLAYER, PLAYER_ON_GOAL = "_", "#", ".", "$", "*", "@", "+"


@dataclass(frozen=True)
class SokobanBoard:
    """Cells are (row, column) from 0; every cell of the `rows` x `cols` rectangle that is not floor is a wall."""

    rows: int
    cols: int
    floor: frozenset
    goals: frozenset
    boxes: frozenset
    player: tuple[int, int]


@dataclass(frozen=True)
class SokobanDifficulty:
    """Generator settings: map size (border walls included), boxes, the room-carving walk's length, the backward
    game's length, and the least number of moves an optimal solution needs."""

    rows: int = 6
    cols: int = 6
    num_boxes: int = 1
    carve_steps: int = 25
    pull_steps: int = 80
    min_moves: int = 4

    def __post_init__(self):
        if not (isinstance(self.rows, int) and isinstance(self.cols, int) and self.rows >= 4 and self.cols >= 4):
            raise ValueError(f"SokobanDifficulty needs rows, cols >= 4, got rows={self.rows!r}, cols={self.cols!r}.")
        if not isinstance(self.num_boxes, int) or not 1 <= self.num_boxes <= (self.rows - 2) * (self.cols - 2) // 3:
            raise ValueError(
                f"SokobanDifficulty.num_boxes must be between 1 and a third of the inner cells, got "
                f"{self.num_boxes!r}."
            )
        for name in ("carve_steps", "pull_steps", "min_moves"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"SokobanDifficulty.{name} must be a positive integer, got {getattr(self, name)!r}.")


# The paper's Sokoban is 6x6 (PettingLLMs README; the reference's training script sets env.map_size=6) with one box
# and a 25-step carving walk (the reference's generate_room(num_boxes=1, num_steps=25)). The backward game's length
# and the least optimal solution (4 moves; 4 to 11 seen over 250 seeds) are ours. "easy" is ours.
SOKOBAN_DIFFICULTIES = {
    "paper": SokobanDifficulty(rows=6, cols=6, num_boxes=1, carve_steps=25, pull_steps=80, min_moves=4),
    "easy": SokobanDifficulty(rows=5, cols=5, num_boxes=1, carve_steps=12, pull_steps=6, min_moves=1),
}


def _step(cell: tuple[int, int], move: str, times: int = 1) -> tuple[int, int]:
    d_row, d_col = MOVES[move]
    return cell[0] + times * d_row, cell[1] + times * d_col


def push(board: SokobanBoard, move: str) -> SokobanBoard | None:
    """The board after `move`, or None when the move is invalid (a wall, or a box that cannot move)."""
    target = _step(board.player, move)
    if target not in board.floor:
        return None
    boxes = board.boxes
    if target in boxes:
        behind = _step(board.player, move, 2)
        if behind not in board.floor or behind in boxes:
            return None
        boxes = (boxes - {target}) | {behind}
    return SokobanBoard(board.rows, board.cols, board.floor, board.goals, boxes, target)


class Sokoban(Puzzle):
    name = "sokoban"
    shaping = SOKOBAN_SHAPING
    answer_example = "Answer: L U R"

    def parse(self, text: str, board: SokobanBoard | None = None) -> list[str]:
        return parse_moves(text)

    def act(self, board: SokobanBoard, action: str) -> tuple[SokobanBoard, bool]:
        after = push(board, action)
        return (board, False) if after is None else (after, True)

    def potential(self, board: SokobanBoard) -> float:
        return -float(sum(min(abs(b[0] - g[0]) + abs(b[1] - g[1]) for g in board.goals) for b in board.boxes))

    def is_solved(self, board: SokobanBoard) -> bool:
        return board.boxes <= board.goals

    def render(self, board: SokobanBoard) -> str:
        def symbol(cell):
            if cell not in board.floor:
                return WALL
            if cell == board.player:
                return PLAYER_ON_GOAL if cell in board.goals else PLAYER
            if cell in board.boxes:
                return BOX_ON_GOAL if cell in board.goals else BOX
            return GOAL if cell in board.goals else FLOOR

        return "\n".join("".join(symbol((r, c)) for c in range(board.cols)) for r in range(board.rows))

    def describe(self, board: SokobanBoard) -> str:
        on_goals = len(board.boxes & board.goals)
        return (
            "Sokoban: push every box onto a goal.\n"
            "'#' wall, '_' floor, '.' goal, '$' box, '*' box on a goal, '@' you, '+' you on a goal. Rows and columns "
            "count from 0 at the top left.\n"
            f"\n{self.render(board)}\n\n"
            f"Boxes on goals: {on_goals} of {len(board.boxes)}. You are at row {board.player[0]}, column "
            f"{board.player[1]}.\n"
            "Moves: U (up), D (down), L (left), R (right), as capital letters. Walking into a box pushes it one cell "
            "if the cell behind it is free; boxes cannot be pulled. A move into a wall, or a push into a wall or "
            "another box, is invalid: nothing moves, and it costs more than a step."
        )

    def solve(self, board: SokobanBoard) -> list[str] | None:
        """Breadth-first search over (player, boxes): an optimal list of moves, or None when there is none (or the
        search passes MAX_SOLVER_STATES)."""
        start = (board.player, board.boxes)
        parents = {start: None}
        queue = deque([board])
        while queue:
            current = queue.popleft()
            if self.is_solved(current):
                moves, key = [], (current.player, current.boxes)
                while parents[key] is not None:
                    key, move = parents[key]
                    moves.append(move)
                return moves[::-1]
            for move in MOVES:
                after = push(current, move)
                if after is None or (after.player, after.boxes) in parents:
                    continue
                parents[(after.player, after.boxes)] = ((current.player, current.boxes), move)
                if len(parents) > MAX_SOLVER_STATES:
                    return None
                queue.append(after)
        return None

    def generate(self, seed: int, difficulty: SokobanDifficulty) -> SokobanBoard:
        rng = random.Random(seed)
        for _ in range(MAX_TRIES):
            floor = _carve(rng, difficulty)
            if len(floor) < 2 * difficulty.num_boxes + 1:
                continue
            cells = rng.sample(sorted(floor), difficulty.num_boxes + 1)
            goals = frozenset(cells[1:])
            board = _pull_back(
                rng, SokobanBoard(difficulty.rows, difficulty.cols, floor, goals, goals, cells[0]), difficulty
            )
            if self.is_solved(board):
                continue
            solution = self.solve(board)
            if solution is not None and len(solution) >= difficulty.min_moves:
                return board
        raise ValueError(
            f"No Sokoban board for {difficulty} after {MAX_TRIES} rooms (seed {seed}): lower `min_moves` or "
            "`num_boxes`, or raise `carve_steps` or `pull_steps`."
        )

    def to_json(self, board: SokobanBoard) -> str:
        return json.dumps({"map": self.render(board).split("\n")})

    def from_json(self, cell: str) -> SokobanBoard:
        return parse_map(json.loads(cell)["map"])


def parse_map(lines: list[str]) -> SokobanBoard:
    """A board from its drawing (the symbols of `Sokoban.render`); raises ValueError on an unknown symbol, a ragged
    map, no player or several, or fewer goals than boxes."""
    if not lines or len({len(line) for line in lines}) != 1:
        raise ValueError(f"A Sokoban map needs rows of equal length, got {lines!r}.")
    floor, goals, boxes, players = set(), set(), set(), []
    for r, line in enumerate(lines):
        for c, symbol in enumerate(line):
            if symbol not in (FLOOR, WALL, GOAL, BOX, BOX_ON_GOAL, PLAYER, PLAYER_ON_GOAL):
                raise ValueError(f"Unknown Sokoban symbol {symbol!r} at row {r}, column {c} of {lines!r}.")
            if symbol != WALL:
                floor.add((r, c))
            if symbol in (GOAL, BOX_ON_GOAL, PLAYER_ON_GOAL):
                goals.add((r, c))
            if symbol in (BOX, BOX_ON_GOAL):
                boxes.add((r, c))
            if symbol in (PLAYER, PLAYER_ON_GOAL):
                players.append((r, c))
    if len(players) != 1 or len(goals) < len(boxes) or not boxes:
        raise ValueError(
            f"A Sokoban map needs one player, at least one box and a goal for each box; got {len(players)} player(s), "
            f"{len(boxes)} box(es), {len(goals)} goal(s) in {lines!r}."
        )
    return SokobanBoard(len(lines), len(lines[0]), frozenset(floor), frozenset(goals), frozenset(boxes), players[0])


def _carve(rng: random.Random, difficulty: SokobanDifficulty) -> frozenset:
    """The floor: the cells a random walk visits inside the border walls, turning with chance CHANGE_DIRECTION."""
    cell = (rng.randrange(1, difficulty.rows - 1), rng.randrange(1, difficulty.cols - 1))
    floor, move = {cell}, rng.choice(sorted(MOVES))
    for _ in range(difficulty.carve_steps):
        if rng.random() < CHANGE_DIRECTION:
            move = rng.choice(sorted(MOVES))
        target = _step(cell, move)
        if 1 <= target[0] < difficulty.rows - 1 and 1 <= target[1] < difficulty.cols - 1:
            cell = target
            floor.add(cell)
    return frozenset(floor)


def _pull_back(rng: random.Random, board: SokobanBoard, difficulty: SokobanDifficulty) -> SokobanBoard:
    """Play the game backwards from `board`: the player walks, and may pull the box behind it along (the reverse of a
    push). Every board reached this way can be pushed back to the start."""
    player, boxes = board.player, set(board.boxes)
    for _ in range(difficulty.pull_steps):
        move = rng.choice(sorted(MOVES))
        target = _step(player, move)
        if target not in board.floor or target in boxes:
            continue
        behind = _step(player, move, -1)
        if behind in boxes and rng.random() < PULL_CHANCE:
            boxes = (boxes - {behind}) | {player}
        player = target
    return SokobanBoard(board.rows, board.cols, board.floor, board.goals, frozenset(boxes), player)


SOKOBAN = Sokoban()
