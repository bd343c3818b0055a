"""The demo end to end, fast variant: the real `rlproxy serve` (tiny model, trainer on) and the agent."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import psutil
import pytest

from rlproxy.demo.run import run_demo


@pytest.mark.timeout(600)
def test_fast_demo_writes_a_sane_summary(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RLPROXY_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("RLPROXY_API_KEY", "ignored-by-the-demo")  # the demo's server runs without one
    lines: list[str] = []
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    summary = run_demo(5, fast=True, out_dir=tmp_path / "out", echo=lines.append)

    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert summary["groups"] == 3 and len(summary["rows"]) == 3
    for key in ("first3_mean_reward", "last3_mean_reward"):
        assert 0.0 <= summary[key] <= 1.0
    assert 0 < summary["minutes"] < 5
    assert summary["model"] == "tiny" and summary["stop_reason"] == "max_groups"
    assert 50 < summary["peak_rss_mb"] < 8000
    assert all(r["runs"] == 4 and r["status"] in ("trained", "skipped") for r in summary["rows"])
    # where each group's sampling went in the engine: 4 two-turn episodes, every token decoded
    for r in summary["rows"]:
        e = r["engine"]
        assert e["decode_steps"] > 0 and 0 < e["mean_rows"] <= 4 and e["tokens"] >= e["decode_steps"]
        assert 0 < e["decode_s"] + e["prefill_s"] <= r["sample_seconds"]
        assert 0 < e["prefill_tokens"] <= e["prompt_tokens"]
    # every setting the demo changed is printed and stored, with its default
    changed = summary["settings_changed"]
    assert "group_size" not in changed  # fast: groups of 4, the default
    assert changed["poll_interval"] == {"value": 0.2, "default": 1.0, "source": "demo"}
    assert "learning_rate" not in changed  # the demo trains with serve's default (by model size)
    printed = [line for line in lines if line.startswith("settings changed from the defaults: ")]
    assert printed and all("poll_interval=0.2 (default 1.0)" in line for line in printed)
    plot = Path(summary["plot"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the trajectories are in SQL, as the printed query says: 12 two-call runs with their rewards
    with sqlite3.connect(summary["db"]) as db:
        n_runs, n_rewarded = db.execute("SELECT count(*), count(reward) FROM runs").fetchone()
        calls = db.execute("SELECT DISTINCT n_completions FROM trajectories").fetchall()
        db.execute(summary["sql"].splitlines()[0]).fetchall()
        steps = db.execute("SELECT step, adapter_path FROM training_steps ORDER BY step").fetchall()
    assert (n_runs, n_rewarded) == (12, 12)
    assert calls == [(2,)]
    assert any("group   3" in line for line in lines) and any("sqlite3" in line for line in lines)
    # the rows' steps are the trainer's; a pruned step's adapter_path names no deleted folder
    assert [r["step"] for r in summary["rows"] if r["step"] is not None] == [s for s, _ in steps]
    assert all(path is None or Path(path).is_dir() for _, path in steps)
    assert len(steps) < 3 or steps[0][1] is None  # keep_checkpoints=2: step 1 was pruned

    # the server is stopped
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
