"""The demo task's reward: exact values for the replies a small model really gives."""

from __future__ import annotations

import pytest

from rlproxy.demo import number_game as task


@pytest.mark.parametrize(
    ("first", "second", "reward"),
    [
        ("7", "8", 1.0),
        (" 7\n", "8.", 1.0),
        ("7", "9", 0.3),
        ("7", "The answer is 8", 0.3),  # turn 2 must be only the result
        ("I pick 7", "8", 0.7),  # the number counts even when turn 1 was chatty
        ("I pick 7", "9", 0.0),
        ("seven", "8", 0.0),
        ("", "", 0.0),
        (None, None, 0.0),
        ("10", "11", 1.0),
    ],
)
def test_score(first, second, reward):
    value, metrics = task.score(first, second)
    assert value == pytest.approx(reward)
    assert 0.0 <= value <= 1.0
    assert set(metrics) == {"digits_only", "correct"}


def test_first_number():
    assert task.first_number("My number is 4, or 5") == 4
    assert task.first_number("none") is None
