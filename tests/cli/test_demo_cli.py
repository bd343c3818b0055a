"""`rlproxy demo`'s flags reach the demo they start: the step budget (`--max-groups`) for both paths."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from rlproxy.cli.main import app
from rlproxy.demo import distill, run

runner = CliRunner()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}

    def fake_run_demo(**kwargs: Any) -> dict[str, Any]:
        seen["rl"] = kwargs
        return {"improvement": 1.0}

    def fake_distill(**kwargs: Any) -> dict[str, Any]:
        seen["distill"] = kwargs
        return {}

    monkeypatch.setattr(run, "run_demo", fake_run_demo)
    monkeypatch.setattr(distill, "run_distill_demo", fake_distill)
    return seen


def test_max_groups_is_the_rl_demos_step_budget(calls: dict[str, dict[str, Any]]) -> None:
    result = runner.invoke(app, ["demo", "--task", "directory", "--max-groups", "20", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert calls["rl"]["max_groups"] == 20 and calls["rl"]["task"] == "directory" and calls["rl"]["seed"] == 2


def test_max_groups_is_the_distill_demos_rl_budget(calls: dict[str, dict[str, Any]]) -> None:
    result = runner.invoke(app, ["demo", "--task", "directory", "--teacher", "--max-groups", "5"])
    assert result.exit_code == 0, result.output
    assert calls["distill"]["rl_groups"] == 5 and "rl" not in calls
    assert calls["distill"]["teacher_episodes"] is None  # the demo's own default (32)


def test_teacher_episodes_reach_the_distill_demo(calls: dict[str, dict[str, Any]]) -> None:
    result = runner.invoke(app, ["demo", "--task", "directory", "--teacher", "--teacher-episodes", "8"])
    assert result.exit_code == 0, result.output
    assert calls["distill"]["teacher_episodes"] == 8


def test_teacher_episodes_without_teacher_is_a_usage_error(calls: dict[str, dict[str, Any]]) -> None:
    result = runner.invoke(app, ["demo", "--task", "directory", "--teacher-episodes", "8"])
    assert result.exit_code == 2 and "--teacher" in result.output and not calls


def test_no_max_groups_keeps_each_demos_default(calls: dict[str, dict[str, Any]]) -> None:
    assert runner.invoke(app, ["demo"]).exit_code == 0
    assert runner.invoke(app, ["demo", "--task", "directory", "--teacher"]).exit_code == 0
    assert calls["rl"]["max_groups"] is None and calls["distill"]["rl_groups"] is None


@pytest.mark.parametrize("bad", ["0", "-1", "x"])
def test_max_groups_must_be_a_positive_count(calls: dict[str, dict[str, Any]], bad: str) -> None:
    result = runner.invoke(app, ["demo", "--max-groups", bad])
    assert result.exit_code == 2 and not calls
