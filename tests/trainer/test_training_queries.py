"""storage/training.py on real SQLite files: readiness, skipped groups, commit exactly once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.errors import StepConflict
from rlproxy.storage.training import (
    commit_step,
    latest_step,
    load_runs,
    ready_groups,
    skip_groups,
    step_exists,
)


async def _status(engine: AsyncEngine) -> dict[str, tuple[str, int | None]]:
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT id, status, trained_step FROM runs"))).all()
    return {r.id: (r.status, r.trained_step) for r in rows}


async def test_ready_by_size(engine: AsyncEngine, add_run: Any) -> None:
    for i in range(3):
        await add_run(engine, f"a{i}", group_id="A", reward=float(i))
    await add_run(engine, "a-open", group_id="A", reward=None, status="open")
    assert await ready_groups(engine, group_size=4, group_timeout=600) == []
    await add_run(engine, "a3", group_id="A", reward=3.0)
    [g] = await ready_groups(engine, group_size=4, group_timeout=600)
    assert (g.policy, g.group_id, sorted(g.run_ids)) == ("tiny", "A", ["a0", "a1", "a2", "a3"])
    assert not g.zero_variance


async def test_ready_by_timeout_needs_two(engine: AsyncEngine, add_run: Any) -> None:
    await add_run(engine, "b0", group_id="B", reward=1.0, completed_ago=700)
    assert await ready_groups(engine, group_size=4, group_timeout=600) == []  # one run is not a group
    await add_run(engine, "b1", group_id="B", reward=0.0, completed_ago=650)
    [g] = await ready_groups(engine, group_size=4, group_timeout=600)
    assert sorted(g.run_ids) == ["b0", "b1"]
    # a fresh reward restarts the wait
    await add_run(engine, "b2", group_id="B", reward=0.0, completed_ago=5)
    assert await ready_groups(engine, group_size=4, group_timeout=600) == []


async def test_groups_are_per_policy_oldest_first(engine: AsyncEngine, add_run: Any) -> None:
    for i in range(2):
        await add_run(engine, f"new{i}", group_id="G", policy="p1", reward=float(i), completed_ago=1)
        await add_run(engine, f"old{i}", group_id="G", policy="p2", reward=float(i), completed_ago=100)
    groups = await ready_groups(engine, group_size=2, group_timeout=600)
    assert [(g.policy, g.group_id) for g in groups] == [("p2", "G"), ("p1", "G")]


async def test_zero_variance_groups_are_skipped(engine: AsyncEngine, add_run: Any) -> None:
    for i in range(2):
        await add_run(engine, f"z{i}", group_id="Z", reward=0.5)
    [g] = await ready_groups(engine, group_size=2, group_timeout=600)
    assert g.zero_variance
    assert await skip_groups(engine, [g]) == 2
    assert await _status(engine) == {"z0": ("skipped", None), "z1": ("skipped", None)}
    assert await ready_groups(engine, group_size=2, group_timeout=600) == []
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM training_steps"))).scalar() == 0


async def test_load_runs(engine: AsyncEngine, add_run: Any) -> None:
    comps = [
        {"prompt_token_ids": [1, 2], "token_ids": [[3]], "logprobs": [[-0.1]], "policy_step": 2},
        {"prompt_token_ids": [1, 2, 3, 4], "token_ids": [[5, 6], [7]], "logprobs": [[-0.2, None], [-0.3]]},
    ]
    await add_run(engine, "r0", reward=0.25, completions=comps)
    [run] = await load_runs(engine, ["r0"])
    assert (run.run_id, run.group_id, run.policy, run.reward) == ("r0", "g1", "tiny", 0.25)
    assert [c.seq for c in run.completions] == [0, 1]
    assert run.completions[0].policy_step == 2
    assert run.completions[1].token_ids == [[5, 6], [7]]
    assert run.completions[1].logprobs == [[-0.2, None], [-0.3]]


async def test_commit_exactly_once(engine: AsyncEngine, add_run: Any) -> None:
    for i in range(2):
        await add_run(engine, f"c{i}", reward=float(i))
    kw: dict[str, Any] = dict(
        policy="tiny", adapter_path="/x", num_groups=1, mean_reward=0.5, metrics={"loss/total": 1.0}
    )
    await commit_step(engine, step=1, run_ids=["c0", "c1"], **kw)
    assert await _status(engine) == {"c0": ("trained", 1), "c1": ("trained", 1)}
    assert await latest_step(engine, "tiny") == 1 and await step_exists(engine, "tiny", 1)
    assert await latest_step(engine, "other") == 0
    # the same runs again, under a new step number: refused, nothing changes
    with pytest.raises(StepConflict, match="no longer completed"):
        await commit_step(engine, step=2, run_ids=["c0", "c1"], **kw)
    # the same step number again with fresh runs: refused too
    await add_run(engine, "c2", reward=0.0)
    with pytest.raises(StepConflict, match="already recorded"):
        await commit_step(engine, step=1, run_ids=["c2"], **kw)
    assert (await _status(engine))["c2"] == ("completed", None)
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text("SELECT step, num_runs, json_extract(metrics, '$.\"loss/total\"') FROM training_steps")
            )
        ).all()
    assert [tuple(r) for r in rows] == [(1, 2, 1.0)]


async def test_commit_all_or_nothing(engine: AsyncEngine, add_run: Any) -> None:
    await add_run(engine, "d0", reward=1.0)
    await add_run(engine, "d1", reward=0.0, status="skipped")
    with pytest.raises(StepConflict):
        await commit_step(engine, policy="tiny", step=1, run_ids=["d0", "d1"], adapter_path=None)
    assert (await _status(engine))["d0"] == ("completed", None)
    assert await latest_step(engine, "tiny") == 0


async def test_concurrent_commits_one_wins(engine: AsyncEngine, add_run: Any, db_url: str) -> None:
    from rlproxy.storage.db import create_engine

    for i in range(4):
        await add_run(engine, f"e{i}", reward=float(i))
    other = create_engine(db_url)  # a second connection pool, like a second process
    try:
        results = await asyncio.gather(
            commit_step(engine, policy="tiny", step=1, run_ids=["e0", "e1", "e2"], adapter_path=None),
            commit_step(other, policy="tiny", step=2, run_ids=["e1", "e2", "e3"], adapter_path=None),
            return_exceptions=True,
        )
    finally:
        await other.dispose()
    assert sum(r is None for r in results) == 1
    assert sum(isinstance(r, StepConflict) for r in results) == 1
    trained = [rid for rid, (s, _) in (await _status(engine)).items() if s == "trained"]
    assert len(trained) == 3
