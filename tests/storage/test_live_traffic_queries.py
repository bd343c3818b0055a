"""Live traffic in storage/training.py, on SQLite and PostgreSQL: lone runs become `ungrouped` with a
reason, batches of them are read oldest first, a step may commit them, and the poll's reads walk an
index from a status instead of scanning every run."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.errors import StepConflict
from rlproxy.storage.models import Run, RunStatus
from rlproxy.storage.training import (
    StatusReason,
    commit_step,
    load_runs,
    mark_runs,
    ready_groups,
    singleton_notice,
    ungroup_runs,
    ungrouped_batch,
)

NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)
TIMEOUT = 60.0


async def add(
    engine: AsyncEngine,
    run_id: str,
    group_id: str | None,
    *,
    ago: float,
    reward: float | None = 1.0,
    policy: str | None = "p",
    status: str = "completed",
) -> None:
    """A run rewarded `ago` seconds before NOW."""
    at = NOW - timedelta(seconds=ago)
    async with engine.begin() as conn:
        await conn.execute(
            insert(Run).values(
                id=run_id,
                group_id=group_id,
                policy=policy,
                status=status,
                reward=reward,
                created_at=at - timedelta(seconds=1),
                completed_at=at if reward is not None else None,
            )
        )


async def rows(engine: AsyncEngine) -> dict[str, tuple[str, str | None]]:
    async with engine.connect() as conn:
        res = await conn.execute(text("SELECT id, status, status_reason FROM runs"))
        return {r.id: (r.status, r.status_reason) for r in res}


async def test_lone_runs_past_the_timeout_are_ungrouped(engine: AsyncEngine) -> None:
    await add(engine, "lone-old", "A", ago=61)
    await add(engine, "lone-new", "B", ago=59)  # still within group_timeout: a sibling may come
    await add(engine, "pair-0", "C", ago=100)  # a ready group (two runs past the timeout): not alone
    await add(engine, "pair-1", "C", ago=70)
    await add(engine, "other-policy", "C", ago=70, policy="q")  # group C of policy q has one run
    await add(engine, "with-trained", "D", ago=70)  # its sibling is trained already: alone now
    await add(engine, "d-trained", "D", ago=80, status="trained")
    await add(engine, "open", "E", ago=500, reward=None, status="open")
    await add(engine, "no-group", None, ago=70)  # never groupable

    assert await ungroup_runs(engine, group_timeout=TIMEOUT, now=NOW) == 4
    got = await rows(engine)
    ungrouped = ("ungrouped", "no_sibling")
    assert got == {
        "lone-old": ungrouped,
        "lone-new": ("completed", None),
        "pair-0": ("completed", None),
        "pair-1": ("completed", None),
        "other-policy": ungrouped,
        "with-trained": ungrouped,
        "d-trained": ("trained", None),
        "open": ("open", None),
        "no-group": ungrouped,
    }
    assert await ungroup_runs(engine, group_timeout=TIMEOUT, now=NOW) == 0  # nothing left to move
    # the pair is still a ready group; a late sibling of an ungrouped run waits for one of its own
    [g] = await ready_groups(engine, group_size=4, group_timeout=TIMEOUT, now=NOW)
    assert sorted(g.run_ids) == ["pair-0", "pair-1"]
    await add(engine, "late-sibling", "A", ago=0)
    later = NOW + timedelta(seconds=61)
    assert await ungroup_runs(engine, group_timeout=TIMEOUT, now=later) == 2  # and lone-new, now 120 s old
    got = await rows(engine)
    assert got["late-sibling"] == got["lone-new"] == ungrouped


async def test_ungrouped_batch_oldest_first_of_one_policy(engine: AsyncEngine) -> None:
    for i, ago in enumerate([300, 200, 250, 150]):
        await add(engine, f"p{i}", f"g{i}", ago=ago, reward=i / 10, status="ungrouped")
    await add(engine, "q0", "gq", ago=100, reward=0.5, policy="q", status="ungrouped")
    await add(engine, "done", "gz", ago=900, reward=0.5, status="trained")

    batch = await ungrouped_batch(engine, batch_size=3, wait=500, now=NOW)
    assert batch is not None and batch.batch and batch.policy == "p"
    assert batch.run_ids == ["p0", "p2", "p1"]  # oldest reward first
    assert batch.rewards == [0.0, 0.2, 0.1]
    # a short batch waits until its newest has waited `wait` seconds, then goes with >= 2 runs
    assert await ungrouped_batch(engine, batch_size=8, wait=200, now=NOW) is None
    short = await ungrouped_batch(engine, batch_size=8, wait=150, now=NOW)
    assert short is not None and short.run_ids == ["p0", "p2", "p1", "p3"]
    assert short.newest_at == NOW - timedelta(seconds=150)

    # the runs come back marked as ungrouped, and a step may commit them; they keep their reason
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE runs SET status_reason = 'no_sibling' WHERE status = 'ungrouped'"))
    loaded = await load_runs(engine, ["p0", "p1"])
    assert [r.ungrouped for r in loaded] == [True, True]
    await commit_step(engine, policy="p", step=1, run_ids=short.run_ids, adapter_path=None)
    got = await rows(engine)
    assert all(got[f"p{i}"] == ("trained", "no_sibling") for i in range(4))
    # policy q is the only one left; a lone ungrouped run never makes a batch
    assert await ungrouped_batch(engine, batch_size=8, wait=0, now=NOW) is None
    with pytest.raises(StepConflict):  # trained runs cannot be trained again
        await commit_step(engine, policy="p", step=2, run_ids=["p0"], adapter_path=None)


async def test_mark_runs_records_the_reason(engine: AsyncEngine) -> None:
    await add(engine, "a", "A", ago=10)
    await add(engine, "b", "B", ago=10, status="ungrouped")
    await add(engine, "c", "C", ago=10, status="trained")
    assert await mark_runs(engine, ["a", "b", "c"], RunStatus.skipped, StatusReason.zero_variance) == 2
    got = await rows(engine)
    assert got == {
        "a": ("skipped", "zero_variance"),
        "b": ("skipped", "zero_variance"),
        "c": ("trained", None),
    }


def test_singleton_notice() -> None:
    base = {s.value: 0 for s in RunStatus}
    assert singleton_notice(base) is None
    few = {**base, "ungrouped": 19}  # too few runs to judge
    assert singleton_notice(few) is None
    half = {**base, "ungrouped": 20, "trained": 12, "skipped": 4, "completed": 4}  # 20 of 40: not most
    assert singleton_notice(half) is None
    most = {**base, "ungrouped": 21, "trained": 12, "skipped": 4, "completed": 4, "open": 500, "failed": 9}
    notice = singleton_notice(most)
    assert notice is not None
    assert notice.startswith("21 of 41 rewarded runs (51%) are ungrouped")
    assert "RLPROXY_SINGLETONS=train" in notice and "X-Group-Id" in notice


@pytest.mark.parametrize("db_kind", ["sqlite"])
async def test_poll_reads_walk_an_index(engine: AsyncEngine, migrated_url: str) -> None:
    """The poll's reads start from a status on an index: none scans the runs table, even after ANALYZE
    (without per-value statistics SQLite then thinks a status matches half the table)."""
    for i in range(30):
        await add(engine, f"u{i}", f"g{i}", ago=1000 + i, status="ungrouped")
    for i in range(3):
        await add(engine, f"c{i}", "waiting", ago=10)
    path = migrated_url.split("///", 1)[1]
    con = sqlite3.connect(path)
    try:
        con.execute("ANALYZE")
        # the statistics of 100,000 runs in two statuses, as ANALYZE wrote them for bench/poll.py
        for index, stat in [
            ("ix_runs_status_completed", "100065 50033 1 1"),
            ("ix_runs_status_group", "100065 50033 1"),
            ("ix_runs_status", "100065 50033"),
            ("ix_runs_group_id", "100065 1"),
            ("ix_runs_created_at", "100065 1 1"),
            ("sqlite_autoindex_runs_1", "100065 1"),
        ]:
            con.execute("UPDATE sqlite_stat1 SET stat = ? WHERE tbl = 'runs' AND idx = ?", (stat, index))
        con.commit()
    finally:
        con.close()
    statements: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, parameters))

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        await ungroup_runs(engine, group_timeout=TIMEOUT, now=NOW)
        await ready_groups(engine, group_size=4, group_timeout=TIMEOUT, now=NOW)
        await ungrouped_batch(engine, batch_size=16, wait=0, now=NOW)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
    assert len(statements) == 4
    con = sqlite3.connect(path)
    try:
        for sql, params in statements:
            plan = " | ".join(r[-1] for r in con.execute(f"EXPLAIN QUERY PLAN {sql}", params))
            assert "USING INDEX ix_runs_status" in plan or "USING COVERING INDEX ix_runs_status" in plan, plan
            assert "SCAN runs" not in plan, plan
            assert "TEMP B-TREE FOR ORDER BY" not in plan, plan  # no sort of every ungrouped run
    finally:
        con.close()
