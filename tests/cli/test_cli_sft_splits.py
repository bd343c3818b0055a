"""SFT respects splits and asks before going live (issue 26, item 6). Today's code: `--where
"... AND split = 'train'"` failed (`no such column: split`) though export accepted it, a validated
(held-out) run was trained on, and `rlproxy sft --policy P` changed the served policy at once."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest
from cli_helpers import sample_db
from typer.testing import CliRunner

from rlproxy.cli import main
from rlproxy.storage import export
from rlproxy.storage.db import create_engine, normalize_url
from rlproxy.trainer.offline import sft_condition

runner = CliRunner()


@pytest.fixture
def db(tmp_path) -> str:
    path = sample_db(tmp_path / "s.db")
    with sqlite3.connect(path) as conn:  # one held-out run among the good ones
        conn.execute("UPDATE runs SET split = 'val', status = 'validated' WHERE id = 'a'")
    return str(path)


def _ids(db: str, where: str, params: dict[str, Any] | None = None) -> list[str]:
    async def go() -> list[str]:
        engine = create_engine(normalize_url(db))
        try:
            return await export.select_run_ids(engine, where, params)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def test_where_reads_the_runs_columns_as_export_does(db):
    assert "a" in _ids(db, "reward >= 0.9")
    assert "a" not in _ids(db, "reward >= 0.9 AND split = 'train'")  # `split` is a runs column
    assert _ids(db, "policy = 'nope'") == []


@pytest.fixture
def sft_calls(monkeypatch) -> list[dict[str, Any]]:
    from rlproxy.cli import processes

    calls: list[dict[str, Any]] = []

    async def fake_sft(settings: Any, policy: str, **kw: Any) -> dict[str, Any]:
        calls.append({"policy": policy, **kw})
        return {
            "step": 2,
            "loss/total": 1.0,
            "sft/token_accuracy": 0.5,
            "sft/examples": 3,
            "adapter_path": "x",
        }

    async def fake_fork(settings: Any, source: str, new: str) -> Any:
        calls.append({"fork": (source, new)})

    monkeypatch.setattr(processes, "run_sft", fake_sft)
    monkeypatch.setattr(processes, "fork", fake_fork)
    return calls


def test_sft_asks_before_going_live(db, sft_calls):
    out = runner.invoke(main.app, ["sft", "--policy", "p", "--where", "reward >= 0.9", "--db", db])
    assert out.exit_code == 2 and "--into NEW_POLICY" in out.output and "--publish" in out.output
    assert sft_calls == []


def test_sft_leaves_validation_runs_out_unless_asked(db, sft_calls):
    out = runner.invoke(
        main.app, ["sft", "--policy", "p", "--where", "reward >= 0.9", "--publish", "--db", db]
    )
    assert out.exit_code == 0, out.output
    call = sft_calls[-1]
    assert call["where"] == "reward >= 0.9" and call["include_val"] is False
    # what the trainer then selects (trainer/offline.py): the held-out run is not among them
    assert "a" not in _ids(db, *sft_condition(call["where"], None, None, call["include_val"]))
    out = runner.invoke(
        main.app,
        ["sft", "--policy", "p", "--where", "reward >= 0.9", "--publish", "--include-val", "--db", db],
    )
    assert out.exit_code == 0 and sft_calls[-1]["include_val"] is True
    assert "a" in _ids(db, *sft_condition("reward >= 0.9", None, None, True))


def test_sft_into_a_fork(db, sft_calls):
    with sqlite3.connect(db) as conn:
        policy, step = conn.execute(
            "SELECT policy, max(step) FROM training_steps WHERE adapter_path IS NOT NULL GROUP BY policy"
        ).fetchone()
    out = runner.invoke(main.app, ["sft", "--policy", policy, "--file", db, "--into", "exp", "--db", db])
    assert out.exit_code == 0, out.output
    # one step: exp@1 is POLICY's newest step after SFT (trainer/offline.py run_sft `into`)
    assert len(sft_calls) == 1 and sft_calls[0]["policy"] == policy and sft_calls[0]["into"] == "exp"
    assert step >= 1
    assert f"{policy} is unchanged" in out.output and "RLPROXY_MODEL_MAP='*=exp'" in out.output


def test_export_records_carry_split_time_and_reward_source(db, tmp_path):
    """Issue 26 item 7: export records lacked split, completed_at and reward_source."""
    import json

    out_file = tmp_path / "runs.jsonl"
    out = runner.invoke(main.app, ["export", "--format", "jsonl", "--out", str(out_file), "--db", db])
    assert out.exit_code == 0, out.output
    recs = {r["run_id"]: r for r in map(json.loads, out_file.read_text().splitlines())}
    assert recs["a"]["split"] == "val" and recs["b"]["split"] == "train"
    assert recs["a"].get("reward_source") in ("app", None)  # JSONL leaves a null key out
    assert recs["a"]["completed_at"].endswith("+00:00") and recs["a"]["policy"]
    where = "split = 'train' AND reward > 0.5"  # the runs' columns, as sft --where reads them
    picked = tmp_path / "t.jsonl"
    out = runner.invoke(
        main.app, ["export", "--format", "jsonl", "--out", str(picked), "--db", db, "--where", where]
    )
    assert out.exit_code == 0, out.output
    ids = [json.loads(line)["run_id"] for line in picked.read_text().splitlines()]
    assert ids and "a" not in ids


def test_the_group_the_trainer_waits_for(db):
    """Issue 26 item 9: the trainer logs "waiting for rewarded runs: group 2/4 of g2" from this."""
    from rlproxy.storage.overview import fullest_waiting_group

    async def go() -> object:
        engine = create_engine(normalize_url(db))
        try:
            return await fullest_waiting_group(engine)
        finally:
            await engine.dispose()

    with sqlite3.connect(db) as conn:
        want = conn.execute(
            "SELECT policy, group_id, count(*) FROM runs WHERE status = 'completed' AND reward IS NOT NULL "
            "AND split = 'train' GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 1"
        ).fetchone()
    assert asyncio.run(go()) == tuple(want)
