"""`rlproxy demo --task directory --teacher`, fast variant: the plumbing of the three rungs.

The real `rlproxy serve` (tiny model, trainer on), the stand-in provider as the hosted teacher, the
real `rlproxy sft --from-policy` in its own process. What is learned is measured on SmolLM2 (docs).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from rlproxy.demo.distill import run_distill_demo
from rlproxy.demo.rungs import COMPONENTS, prompt_split


def test_prompts_never_overlap() -> None:
    teacher, evaluation, rl = prompt_split(3, 32, 16, 20)
    assert len(set(teacher) | set(evaluation) | set(rl)) == 68
    assert prompt_split(3, 32, 16, 20) == (teacher, evaluation, rl)  # the same per seed


@pytest.mark.timeout(600)
def test_fast_distill_demo(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPROXY_CACHE_DIR", str(cache_dir))
    lines: list[str] = []
    summary = run_distill_demo(fast=True, out_dir=tmp_path / "out", threads=1, echo=lines.append)
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert [r["rung"] for r in summary["rungs"]] == ["base", "sft", "rl"]
    for r in summary["rungs"]:
        assert r["episodes"] == 4 and 0.0 <= r["mean_reward"] <= 1.0
        assert all(0.0 <= r[c] <= 1.0 for c in COMPONENTS)
    assert summary["teacher_rung"]["mean_reward"] == 1.0  # the scripted expert: every episode right
    assert any("stands for a hosted model" in line for line in lines)
    assert any(line.startswith("  sft: optimizer step") for line in lines)  # the distill's progress
    con = sqlite3.connect(tmp_path / "out" / "rlproxy.db")
    # the teacher's rows: text only and marked; its runs never trained
    assert con.execute(
        "SELECT count(*), sum(source = 'hosted'), sum(token_ids IS NULL) FROM completions "
        "WHERE policy = 'teacher'"
    ).fetchone() == (24, 24, 24)
    trained = "SELECT count(*) FROM runs WHERE policy = 'teacher' AND status = 'trained'"
    assert con.execute(trained).fetchone() == (0,)
    # the rungs are validation runs (never trained); the distilled step is student@1, RL continues it
    assert con.execute("SELECT DISTINCT status FROM runs WHERE split = 'val'").fetchall() == [("validated",)]
    steps = con.execute("SELECT policy, step, kind FROM training_steps ORDER BY step").fetchall()
    assert steps[0] == ("student", 1, "sft") and all(s[0] == "student" and s[2] == "grpo" for s in steps[1:])


@pytest.mark.timeout(600)
def test_fast_directory_demo_measures_rungs(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 21: the RL-only directory demo stores the rungs too (base and after RL), each component."""
    from rlproxy.demo.run import run_demo

    monkeypatch.setenv("RLPROXY_CACHE_DIR", str(cache_dir))
    summary = run_demo(
        5, fast=True, task="directory", out_dir=tmp_path / "out", max_groups=2, echo=lambda _: None
    )
    assert [r["rung"] for r in summary["rungs"]] == ["base", "rl"]
    assert all(r["episodes"] == 4 and all(0.0 <= r[c] <= 1.0 for c in COMPONENTS) for r in summary["rungs"])
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert on_disk["rungs"] == summary["rungs"]
    con = sqlite3.connect(tmp_path / "out" / "rlproxy.db")
    assert con.execute(
        "SELECT count(*) FROM runs WHERE split = 'val' AND status != 'validated'"
    ).fetchone() == (0,)


def _group(reward: float, status: str) -> dict[str, object]:
    return {"mean_reward": reward, "status": status}


def test_rl_stops_only_after_groups_in_a_row_at_the_best_reward() -> None:
    from rlproxy.demo import directory
    from rlproxy.demo.distill import CEILING_GROUPS, at_ceiling

    best = directory.MAX_REWARD
    assert best == 1.0  # two extensions, two lookups, one attempt: the weights add up
    flat = [_group(best, "skipped")] * CEILING_GROUPS
    assert at_ceiling(flat)
    assert not at_ceiling(flat[1:])  # not yet that many in a row
    assert not at_ceiling([*flat[:-1], _group(best, "trained")])  # a trained group: RL still moves
    assert not at_ceiling([*flat[:-1], _group(0.0, "skipped")])  # all zero: variance may come later
    assert not at_ceiling([*flat[:-1], _group(0.95, "skipped")])  # equal but not the best
    assert not at_ceiling([*flat[:-1], _group(None, "failed")])
    assert at_ceiling([_group(0.3, "trained"), *flat])  # only the last ones count
