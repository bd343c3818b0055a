"""storage/shadow.py on SQLite and PostgreSQL: the prompts a shadow check samples, its row's life, and
the rollback row that keeps a stopped step from ever being served or re-loaded."""

from __future__ import annotations

from sqlalchemy import insert, update
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage import queries
from rlproxy.storage import rollouts as rollout_store
from rlproxy.storage import shadow as store
from rlproxy.storage.models import Completion, Run, TrainingStep


async def _call(engine: AsyncEngine, ids: list[int], run_id: str | None = None, **kw: object) -> None:
    async with engine.begin() as conn:
        if run_id is not None:
            status = kw.pop("run_status", "completed")
            await conn.execute(insert(Run).values(id=run_id, policy="p", status=status))
        values = {"run_id": run_id, "seq": 0 if run_id else None, "policy": "p", "status": "ok"}
        values |= {"prompt_token_ids": ids, "request": {"max_tokens": 3}, **kw}
        await conn.execute(insert(Completion).values(**values))


async def test_prompts(engine: AsyncEngine) -> None:
    await _call(engine, [1, 2], "r-trained", run_status="trained")
    await _call(engine, [3], "r-sib")
    async with engine.begin() as conn:
        await conn.execute(update(Run).where(Run.id == "r-sib").values(branch_of=1))
    await _call(engine, [4], "r-step")  # the candidate's own runs (not marked trained yet)
    await _call(engine, [5])
    await _call(engine, [6], source="hosted")
    await _call(engine, [5])
    await _call(engine, [7], "r-open", run_status="open")
    got = await store.recent_prompts(engine, "p", 8, exclude_runs=["r-step"])
    assert [(p.prompt_ids, p.request) for p in got] == [([7], {"max_tokens": 3}), ([5], {"max_tokens": 3})]
    assert await store.recent_prompts(engine, "nobody", 8) == []


async def test_check_rows_and_a_rejected_step(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        for s in (1, 2):
            await conn.execute(insert(TrainingStep).values(policy="p", step=s, adapter_path=f"/ck/{s}"))
    assert await store.serving_step(engine, "p", 3) == 2
    cid = await store.start_check(engine, policy="p", step=3, serving=2, margin=0.05, scorer="checks")
    await store.finish_check(engine, cid, status="error", reason="attempt 1 of 3 failed: x")
    assert await store.start_check(engine, policy="p", step=3, serving=2, margin=0.05, scorer="checks") == cid
    row = await store.get_check(engine, "p", 3)
    assert row is not None and (row["status"], row["reason"]) == ("running", None)
    pairs = [{"completion_id": 1, "candidate": 0.0, "serving": 1.0}]
    await store.finish_check(
        engine,
        cid,
        status="failed",
        reason="r",
        prompts=1,
        candidate_score=0.0,
        serving_score=1.0,
        pairs=pairs,
    )
    [listed] = await store.list_checks(engine, policy="p")
    assert (listed["status"], listed["pairs"], listed["serving_step"]) == ("failed", pairs, 2)

    await store.reject_step(engine, policy="p", step=3, serving=2, reason="shadow: r")
    await store.reject_step(engine, policy="p", step=3, serving=2, reason="shadow: r")  # idempotent
    async with engine.begin() as conn:
        await conn.execute(insert(TrainingStep).values(policy="p", step=3, adapter_path="/ck/3"))
    [r] = await rollout_store.list_rollouts(engine, policy="p")
    assert (r["candidate_step"], r["incumbent_step"], r["status"], r["decided_by"]) == (
        3,
        2,
        "rolled_back",
        "shadow",
    )
    # never re-loaded nor picked up by a replica's poll, even while its checkpoint path is recorded
    assert await queries.latest_adapters(engine) == {"p": (2, "/ck/2")}
    assert (await rollout_store.snapshot(engine))["p"].stable == 2
    assert await store.serving_step(engine, "p", 4) == 2
    assert await rollout_store.rolled_back_adapters(engine) == [("p", 3, "/ck/3")]  # the trainer deletes it
