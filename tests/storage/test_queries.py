"""The reads the proxy, CLI and trainer call (storage/queries.py), on the sample database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage import queries
from rlproxy.storage.models import Completion, Run


async def test_list_runs_newest_first_with_cursor(sample_engine: AsyncEngine) -> None:
    runs, cur = await queries.list_runs(sample_engine, limit=4)
    assert [r["id"] for r in runs] == ["f", "e", "d", "c"]
    assert runs[0]["created_at"].endswith("+00:00") and runs[-1]["n_completions"] == 2
    # new runs arriving between pages do not shift the next page
    async with sample_engine.begin() as conn:
        await conn.execute(
            insert(Run.__table__),
            [{"id": "new", "status": "open", "created_at": datetime.now(UTC)}],
        )
    runs2, cur2 = await queries.list_runs(sample_engine, limit=4, cursor=cur)
    assert [r["id"] for r in runs2] == ["b", "a"] and cur2 is None
    assert [r["id"] for r in (await queries.list_runs(sample_engine, limit=1))[0]] == ["new"]

    assert [r["id"] for r in (await queries.list_runs(sample_engine, status="trained"))[0]] == ["c", "b", "a"]
    assert [r["id"] for r in (await queries.list_runs(sample_engine, group_id="g2"))[0]] == ["e", "d"]
    with pytest.raises(ValueError):
        await queries.list_runs(sample_engine, cursor="not-a-cursor")


async def test_list_runs_stable_on_equal_times(engine: AsyncEngine) -> None:
    t = datetime(2026, 1, 1, tzinfo=UTC)
    async with engine.begin() as conn:
        await conn.execute(
            insert(Run.__table__), [{"id": f"r{i:02d}", "status": "open", "created_at": t} for i in range(25)]
        )
    seen, cur = [], None
    while True:
        page, cur = await queries.list_runs(engine, limit=7, cursor=cur)
        seen += [r["id"] for r in page]
        if cur is None:
            break
    assert seen == [f"r{i:02d}" for i in reversed(range(25))]


async def test_get_run(sample_engine: AsyncEngine) -> None:
    run = await queries.get_run(sample_engine, "a")
    assert run is not None
    assert (run["id"], run["reward"], run["status"], run["trained_step"]) == ("a", 1.0, "trained", 1)
    assert [c["seq"] for c in run["completions"]] == [0, 1]
    assert run["completions"][0]["token_ids"] == [[1, 2]]  # JSON decoded
    assert isinstance(run["completions"][0]["request"], dict)
    assert [m["role"] for m in run["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert (await queries.get_run(sample_engine, "f"))["messages"] == []
    assert await queries.get_run(sample_engine, "nope") is None


async def test_training_steps_and_adapters(sample_engine: AsyncEngine) -> None:
    steps = await queries.list_training_steps(sample_engine)
    assert [(s["policy"], s["step"]) for s in steps] == [("p", 2), ("q", 1), ("p", 1)]  # by finished_at
    assert [s["step"] for s in await queries.list_training_steps(sample_engine, policy="p", limit=1)] == [2]
    # q's only step has no adapter: nothing to re-load for it
    assert await queries.latest_adapters(sample_engine) == {"p": (2, "/ck/p/step-0002")}


async def test_status_counts(sample_engine: AsyncEngine) -> None:
    counts = await queries.run_status_counts(sample_engine)
    assert counts == {
        "open": 1,
        "completed": 2,
        "trained": 3,
        "skipped": 0,
        "failed": 0,
        "expired": 0,
        "ungrouped": 0,
        "validated": 0,
    }


async def test_expire_runs(engine: AsyncEngine) -> None:
    now = datetime.now(UTC)
    old, recent = now - timedelta(hours=2), now - timedelta(seconds=5)
    async with engine.begin() as conn:
        await conn.execute(
            insert(Run.__table__),
            [
                {"id": "stale", "status": "open", "created_at": old},
                {"id": "active", "status": "open", "created_at": old},  # old, but called recently
                {"id": "young", "status": "open", "created_at": recent},
                {"id": "done", "status": "completed", "reward": 1.0, "created_at": old},
            ],
        )
        await conn.execute(
            insert(Completion.__table__),
            [
                {"run_id": "stale", "seq": 0, "created_at": old},
                {"run_id": "active", "seq": 0, "created_at": old},
                {"run_id": "active", "seq": 1, "created_at": recent},
            ],
        )
    assert await queries.expire_runs(engine, 3600) == 1
    async with engine.connect() as conn:
        got = dict((await conn.execute(text("SELECT id, status FROM runs"))).all())
    assert got == {"stale": "expired", "active": "open", "young": "open", "done": "completed"}
    assert await queries.expire_runs(engine, 3600) == 0
