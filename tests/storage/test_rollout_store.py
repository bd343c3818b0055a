"""storage/rollouts.py on SQLite and PostgreSQL: opening a rollout, its arms in the `rollout_runs` view,
one look and one decision per candidate however many processes write, and what a rollback leaves."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.settings import RolloutSettings
from rlproxy.storage import rollouts as store
from rlproxy.storage.db import create_engine
from rlproxy.storage.models import Completion, Rollout, Run, TrainingStep
from rlproxy.storage.rollouts import Verdict
from rlproxy.trainer.rollout_rule import decide


async def _steps(engine: AsyncEngine, policy: str, steps: list[int]) -> None:
    async with engine.begin() as conn:
        await conn.execute(delete(Rollout))  # the shared PostgreSQL database is emptied without it
        for s in steps:
            await conn.execute(insert(TrainingStep).values(policy=policy, step=s, adapter_path=f"/ck/{s}"))


async def _run(engine: AsyncEngine, run_id: str, steps: list[int], reward: float | None, **c) -> None:
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        await conn.execute(
            insert(Run).values(
                id=run_id,
                policy="p",
                group_id="g-" + run_id[:2],
                status="completed",
                reward=reward,
                created_at=now,
            )
        )
        for seq, s in enumerate(steps):
            await conn.execute(
                insert(Completion).values(run_id=run_id, seq=seq, policy="p", policy_step=s, **c)
            )


async def test_open_route_view_and_rollback(engine: AsyncEngine) -> None:
    await _steps(engine, "p", [1, 2])
    async with engine.begin() as conn:  # a run from before the rollout: in no arm
        await conn.execute(
            insert(Run).values(
                id="old", policy="p", reward=1.0, created_at=datetime.now(UTC) - timedelta(hours=1)
            )
        )
        await conn.execute(insert(Completion).values(run_id="old", seq=0, policy="p", policy_step=1))
    rid, inserted = await store.begin(engine, "p", 2, 0.25)
    assert inserted
    assert await store.begin(engine, "p", 2, 0.25) == (rid, False)  # a recovering trainer reuses it
    snap = (await store.snapshot(engine))["p"]
    assert snap.open == store.OpenRollout(rid, 2, 1, 0.25) and snap.stable == 1 and snap.max_step == 2

    await _run(engine, "c1", [2, 2], 1.0, status_code=200, finish_reason="stop")
    await _run(engine, "c2", [2], None, status_code=502)  # errored, no reward
    await _run(engine, "i1", [1], 0.0, status_code=200, finish_reason="length")  # cut at its length
    await _run(engine, "i2", [1, 1], 0.5, status_code=200, finish_reason="stop")
    await _run(engine, "mixed", [1, 2], 1.0, status_code=200)  # spans the swap: neither arm
    bad_tool = {"choices": [{"message": {"content": '<tool_call>{"name": oops</tool_call>'}}]}
    await _run(engine, "c3", [2], 0.0, status_code=200, response=bad_tool)  # a malformed tool call
    cand, inc = await store.arm_runs(engine, rid)
    assert sorted((-1.0 if r.reward is None else r.reward, r.errored) for r in cand) == [
        (-1.0, True),
        (0.0, True),
        (1.0, False),
    ]
    assert sorted((r.reward, r.errored) for r in inc) == [(0.0, True), (0.5, False)]
    async with engine.connect() as conn:
        arms = dict((await conn.execute(text("SELECT run_id, arm FROM rollout_runs"))).all())
    assert arms == {
        "c1": "candidate",
        "c2": "candidate",
        "c3": "candidate",
        "i1": "incumbent",
        "i2": "incumbent",
    }

    assert await store.decide(engine, rid, "rollback", "by hand")
    assert not await store.decide(engine, rid, "promote", "too late")  # one decision per candidate
    snap = (await store.snapshot(engine))["p"]
    assert snap.open is None and snap.rejected == {2} and snap.stable == 1
    assert await store.rolled_back_adapters(engine) == [("p", 2, "/ck/2")]
    row = (await store.list_rollouts(engine, "p"))[0]
    assert row["status"] == "rolled_back" and row["decided_by"] == "manual" and row["decided_at"]
    # the next candidate's incumbent skips the rolled-back step
    async with engine.begin() as conn:
        await conn.execute(insert(TrainingStep).values(policy="p", step=3, adapter_path="/ck/3"))
    rid3, _ = await store.begin(engine, "p", 3, 0.25)
    assert (await store.snapshot(engine))["p"].open == store.OpenRollout(rid3, 3, 1, 0.25)


async def test_one_look_and_one_decision_across_processes(migrated_url: str) -> None:
    engines = [create_engine(migrated_url) for _ in range(4)]
    try:
        await _steps(engines[0], "p", [1])
        rid, _ = await store.begin(engines[0], "p", 1, 0.5)
        verdict = Verdict("promote", "better", look=1, statistic="welch_t", value=3.0, p_value=0.001)
        # four trainers / proxies judge the same look at once: exactly one writes it
        won = await asyncio.gather(*(store.record_look(e, rid, verdict, 0) for e in engines))
        assert sorted(won) == [False, False, False, True]
        row = await store.get_rollout(engines[0], rid)
        assert row["status"] == "promoted" and row["looks"] == 1 and row["decided_by"] == "rule"
        # a later verdict changes nothing on a closed rollout
        late = Verdict("rollback", "worse", look=2, statistic="welch_t", value=-3.0, p_value=0.001)
        assert not await store.record_look(engines[1], rid, late, 1)
        assert (await store.get_rollout(engines[0], rid))["status"] == "promoted"
        assert (await store.snapshot(engines[0]))["p"].stable == 1
    finally:
        for e in engines:
            await e.dispose()


async def test_a_continue_look_is_recorded_once_and_the_rule_reads_the_view(engine: AsyncEngine) -> None:
    await _steps(engine, "p", [1, 2])
    rid, _ = await store.begin(engine, "p", 2, 0.5)
    for i in range(4):
        await _run(engine, f"c{i}", [2], float(i % 2))
        await _run(engine, f"i{i}", [1], float(i % 2))
    cand, inc = await store.arm_runs(engine, rid)
    v = decide(cand, inc, 0, RolloutSettings(canary_min_runs=4, canary_looks=3))
    assert v.look == 1 and v.decision == "continue"
    assert await store.record_look(engine, rid, v, 0)
    assert not await store.record_look(engine, rid, v, 0)  # the same look again: already taken
    row = await store.get_rollout(engine, rid)
    assert row["looks"] == 1 and row["status"] == "canary" and row["candidate_runs"] == 4
    assert row["candidate_reward"] == 0.5 and row["statistic"] == "welch_t"
    series = await store.arm_series(engine, rid)
    assert len(series) == 8 and {s["arm"] for s in series} == {"candidate", "incumbent"}


async def test_two_replicas_on_one_store_serve_the_same_split(migrated_url: str) -> None:
    from rlproxy.proxy.rollout import Router

    engines = [create_engine(migrated_url) for _ in range(2)]
    replicas = [Router({"*": "canary"}) for _ in engines]
    try:
        await _steps(engines[0], "p", [1, 2])
        rid, _ = await store.begin(engines[0], "p", 2, 0.3)
        for r, e in zip(replicas, engines, strict=True):
            await r.refresh(e)
        ids = [f"run-{i}" for i in range(400)]
        a = [replicas[0].route("p", 2, i) for i in ids]
        b = [replicas[1].route("p", 2, i) for i in reversed(ids)][::-1]
        assert a == b and abs(a.count(2) / len(a) - 0.3) <= 0.05
        # one replica's trainer rolls it back; the other replica, once it re-reads, never serves it
        await store.decide(engines[0], rid, "rollback", "test")
        await replicas[1].refresh(engines[1])
        assert {replicas[1].route("p", 2, i) for i in ids} == {1}
    finally:
        for e in engines:
            await e.dispose()
