"""The rules of 2048 in plain Python: no model, no network, so they can be tested alone.

A 4x4 board of powers of two. A move slides every tile as far as it goes in one direction; two
equal tiles that meet merge into one (each tile merges at most once per move) and the merged value
is added to the score. A move that changes nothing is invalid and spawns nothing. After a valid move
a 2 (90%) or a 4 (10%) appears on a random empty cell. The game is over when no move changes the
board; it is won when a 2048 tile appears.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

SIZE = 4
MOVES = ("up", "down", "left", "right")
WIN_TILE = 2048
_MOVE_RE = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)

Grid = list[list[int]]


def slide_row_left(row: list[int]) -> tuple[list[int], int]:
    """Slide one row to the left and merge equal neighbours once; returns (new row, points gained)."""
    tiles = [v for v in row if v]
    out: list[int] = []
    points = 0
    i = 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            out.append(tiles[i] * 2)
            points += tiles[i] * 2
            i += 2  # the merged tile cannot merge again in this move
        else:
            out.append(tiles[i])
            i += 1
    return out + [0] * (len(row) - len(out)), points


def _transpose(grid: Grid) -> Grid:
    return [list(col) for col in zip(*grid, strict=True)]


def apply_move(grid: Grid, move: str) -> tuple[Grid, int]:
    """The board after `move` (without the random spawn) and the points it scored."""
    if move not in MOVES:
        raise ValueError(f"unknown move {move!r}; expected one of {MOVES}")
    # Every direction is "left" on a rotated view of the board.
    if move in ("up", "down"):
        view = _transpose(grid)
    else:
        view = [row[:] for row in grid]
    if move in ("right", "down"):
        view = [row[::-1] for row in view]
    points = 0
    moved: Grid = []
    for row in view:
        new_row, gained = slide_row_left(row)
        moved.append(new_row)
        points += gained
    if move in ("right", "down"):
        moved = [row[::-1] for row in moved]
    if move in ("up", "down"):
        moved = _transpose(moved)
    return moved, points


def parse_move(text: str | None) -> str | None:
    """The first of up/down/left/right in a model's reply (any case, as a whole word), else None."""
    if not text:
        return None
    match = _MOVE_RE.search(text)
    return match.group(1).lower() if match else None


@dataclass
class Game:
    """One game of 2048 with its own random generator (same seed, same spawns for the same moves)."""

    seed: int = 0
    grid: Grid = field(default_factory=lambda: [[0] * SIZE for _ in range(SIZE)])
    score: int = 0
    moves: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        if not any(any(row) for row in self.grid):
            self.spawn()
            self.spawn()

    def spawn(self) -> bool:
        """Put a 2 (90%) or a 4 (10%) on a random empty cell; False when the board is full."""
        empty = [(r, c) for r in range(SIZE) for c in range(SIZE) if self.grid[r][c] == 0]
        if not empty:
            return False
        r, c = self._rng.choice(empty)
        self.grid[r][c] = 4 if self._rng.random() < 0.1 else 2
        return True

    def can_move(self, move: str) -> bool:
        """Whether `move` would change the board."""
        return apply_move(self.grid, move)[0] != self.grid

    def legal_moves(self) -> list[str]:
        return [m for m in MOVES if self.can_move(m)]

    def step(self, move: str) -> bool:
        """Play `move`: slide, merge, score and spawn. Returns False (and changes nothing) if invalid."""
        new_grid, points = apply_move(self.grid, move)
        if new_grid == self.grid:
            return False
        self.grid = new_grid
        self.score += points
        self.moves += 1
        self.spawn()
        return True

    @property
    def max_tile(self) -> int:
        return max(max(row) for row in self.grid)

    @property
    def won(self) -> bool:
        return self.max_tile >= WIN_TILE

    @property
    def over(self) -> bool:
        return not self.legal_moves()

    def render(self) -> str:
        """The board as text, one row a line, `.` for an empty cell, columns aligned."""
        width = max(len(str(self.max_tile)), 1)
        return "\n".join(" ".join((str(v) if v else ".").rjust(width) for v in row) for row in self.grid)


def reward(max_tile: int) -> float:
    """Outcome reward in [0, 1]: log2 of the largest tile over log2(2048), so 2048 scores 1.0.

    A log scale gives partial credit for each doubling; a win-only reward would almost never be
    non-zero for a small model and GRPO learns nothing from groups whose rewards are all equal.
    """
    if max_tile <= 0:
        return 0.0
    return min(1.0, math.log2(max_tile) / math.log2(WIN_TILE))
