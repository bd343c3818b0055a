"""The 2048 example's rules, exact on hand-made boards (no model, no server)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


game = _load("game2048", ROOT / "examples" / "2048" / "game.py")


@pytest.mark.parametrize(
    ("row", "expected", "points"),
    [
        ([0, 0, 0, 0], [0, 0, 0, 0], 0),
        ([2, 0, 0, 2], [4, 0, 0, 0], 4),
        ([2, 2, 2, 2], [4, 4, 0, 0], 8),  # each tile merges once per move
        ([4, 4, 8, 0], [8, 8, 0, 0], 8),  # a merged tile does not merge again
        ([2, 2, 2, 0], [4, 2, 0, 0], 4),  # the leading pair merges first
        ([2, 4, 8, 16], [2, 4, 8, 16], 0),
        ([0, 2, 0, 4], [2, 4, 0, 0], 0),
    ],
)
def test_slide_row_left(row, expected, points):
    assert game.slide_row_left(row) == (expected, points)


def test_apply_move_each_direction():
    grid = [
        [2, 0, 2, 0],
        [0, 4, 0, 4],
        [2, 0, 0, 0],
        [2, 0, 0, 8],
    ]
    assert game.apply_move(grid, "left") == ([[4, 0, 0, 0], [8, 0, 0, 0], [2, 0, 0, 0], [2, 8, 0, 0]], 12)
    assert game.apply_move(grid, "right") == ([[0, 0, 0, 4], [0, 0, 0, 8], [0, 0, 0, 2], [0, 0, 2, 8]], 12)
    assert game.apply_move(grid, "up") == ([[4, 4, 2, 4], [2, 0, 0, 8], [0, 0, 0, 0], [0, 0, 0, 0]], 4)
    assert game.apply_move(grid, "down") == ([[0, 0, 0, 0], [0, 0, 0, 0], [2, 0, 0, 4], [4, 4, 2, 8]], 4)
    with pytest.raises(ValueError):
        game.apply_move(grid, "diagonal")


def test_step_spawns_after_valid_move_only():
    g = game.Game(seed=1, grid=[[2, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert not g.step("left")  # nothing moves: invalid, no spawn
    assert sum(v > 0 for row in g.grid for v in row) == 1
    assert g.moves == 0
    assert g.step("right")
    assert g.grid[0][3] == 2
    assert sum(v > 0 for row in g.grid for v in row) == 2  # the spawn
    assert g.moves == 1


def test_new_game_has_two_tiles_and_is_reproducible():
    a, b = game.Game(seed=7), game.Game(seed=7)
    assert a.grid == b.grid
    tiles = [v for row in a.grid for v in row if v]
    assert len(tiles) == 2 and set(tiles) <= {2, 4}
    for move in ("left", "up", "right", "down"):
        assert a.step(move) == b.step(move)
    assert a.grid == b.grid and a.score == b.score


def test_game_over_and_win():
    full = [[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]]
    g = game.Game(grid=[row[:] for row in full])
    assert g.over and g.legal_moves() == []
    assert not g.won
    g2 = game.Game(grid=[[1024, 1024, 0, 0], [0] * 4, [0] * 4, [0] * 4])
    assert g2.step("left")
    assert g2.won and g2.max_tile == 2048 and g2.score == 2048


@pytest.mark.parametrize(
    ("text", "move"),
    [
        ("up", "up"),
        ("  Left.\n", "left"),
        ("I would go DOWN, then right", "down"),
        ("Move: right!", "right"),
        ("upward", None),  # whole words only
        ("", None),
        (None, None),
        ("north", None),
    ],
)
def test_parse_move(text, move):
    assert game.parse_move(text) == move


def test_reward_scale():
    assert game.reward(0) == 0.0
    assert game.reward(2) == pytest.approx(1 / 11)
    assert game.reward(128) == pytest.approx(7 / 11)
    assert game.reward(2048) == 1.0
    assert game.reward(4096) == 1.0


def test_render_aligns_columns():
    g = game.Game(grid=[[2, 0, 0, 128], [0] * 4, [0] * 4, [0] * 4])
    assert g.render().splitlines()[0] == "  2   .   . 128"
