"""Validation runs in storage, on SQLite and PostgreSQL: the split is fixed by a run's first record and
by its reward, a val run becomes `validated` and no selection ever takes it, a step records exactly the
mean reward of the val runs its previous adapter served, and the `validation` view agrees."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.errors import SplitConflict, StepConflict
from rlproxy.storage.models import Completion, Run
from rlproxy.storage.records import CompletionRecord
from rlproxy.storage.rows import apply_reward, ensure_runs, insert_completions
from rlproxy.storage.training import commit_step, ready_groups, ungrouped_batch
from rlproxy.storage.validation import best_step, pick_best, step_scores

NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)


async def write(engine: AsyncEngine, *records: CompletionRecord) -> None:
    """Records stored as the writer stores them (one transaction)."""
    async with engine.begin() as conn:
        first = await ensure_runs(conn, list(records))
        await insert_completions(conn, list(records), first, NOW)


async def reward(engine: AsyncEngine, run_id: str, value: float | None, split: str | None = None):
    async with engine.begin() as conn:
        return await apply_reward(conn, run_id, value, None, None, NOW, split=split)


async def runs(engine: AsyncEngine) -> dict[str, tuple[str, str]]:
    async with engine.connect() as conn:
        return {
            r.id: (r.status, r.split) for r in await conn.execute(text("SELECT id, status, split FROM runs"))
        }


async def test_split_fixed_by_first_record_and_reward(engine: AsyncEngine) -> None:
    await write(
        engine,
        CompletionRecord(run_id="h", policy="p", policy_step=0, split="val"),
        CompletionRecord(run_id="t", policy="p", policy_step=0),
    )
    await write(engine, CompletionRecord(run_id="t", policy="p", policy_step=0, split="val"))  # too late
    assert await runs(engine) == {"h": ("open", "val"), "t": ("open", "train")}

    assert isinstance(await reward(engine, "h", 0.5, "train"), SplitConflict)  # a val run is no train run
    assert isinstance(await reward(engine, "h", None), SplitConflict)  # nor one for the judge
    assert await reward(engine, "h", 0.5) is True
    assert await reward(engine, "h", 0.5, "val") is False  # the same again
    assert await reward(engine, "t", 1.0) is True
    assert isinstance(await reward(engine, "t", 1.0, "val"), SplitConflict)  # rewarded as train already
    assert await runs(engine) == {"h": ("validated", "val"), "t": ("completed", "train")}

    await write(engine, CompletionRecord(run_id="b", policy="p", policy_step=0))
    assert await reward(engine, "b", 0.25, "val") is True  # the reward body's split
    assert (await runs(engine))["b"] == ("validated", "val")


async def add(
    engine: AsyncEngine, run_id: str, reward: float, steps: list[int], *, status: str, split: str, group: str
) -> None:
    """A rewarded run of policy p whose completions were served by `steps`."""
    async with engine.begin() as conn:
        await conn.execute(
            insert(Run).values(
                id=run_id,
                group_id=group,
                policy="p",
                status=status,
                split=split,
                reward=reward,
                created_at=NOW - timedelta(seconds=10),
                completed_at=NOW - timedelta(seconds=5),
            )
        )
        for seq, step in enumerate(steps):
            await conn.execute(
                insert(Completion).values(
                    run_id=run_id,
                    seq=seq,
                    policy="p",
                    policy_step=step,
                    prompt_token_ids=[1, 2],
                    token_ids=[[3]],
                    logprobs=[[-0.5]],
                )
            )


async def test_val_runs_never_selected_and_step_records_val_mean(engine: AsyncEngine) -> None:
    for i, r in enumerate([0.0, 1.0, 0.5, 0.5]):
        await add(engine, f"t{i}", r, [0], status="completed", split="train", group="g")
    # val runs: in the same group, served by step 0 (two), by step 1, and across a hot-swap (0 then 1)
    await add(engine, "v0", 0.25, [0, 0], status="validated", split="val", group="g")
    await add(engine, "v1", 1.0, [0], status="validated", split="val", group="g")
    await add(engine, "v2", 0.75, [1], status="validated", split="val", group="g")
    await add(engine, "vx", 0.0, [0, 1], status="validated", split="val", group="g")
    # a val run whose status was set to `completed` by hand: the split still keeps it out
    await add(engine, "vc", 0.0, [0], status="completed", split="val", group="g")
    await add(engine, "vu", 0.0, [0], status="ungrouped", split="val", group="u")
    await add(engine, "vu2", 1.0, [0], status="ungrouped", split="val", group="u2")

    groups = await ready_groups(engine, group_size=4, group_timeout=60, now=NOW)
    assert [(g.group_id, sorted(g.run_ids)) for g in groups] == [("g", ["t0", "t1", "t2", "t3"])]
    assert await ungrouped_batch(engine, batch_size=2, wait=0, now=NOW) is None
    with pytest.raises(StepConflict):
        await commit_step(engine, policy="p", step=1, run_ids=["t0", "vc"], adapter_path=None)

    await commit_step(engine, policy="p", step=1, run_ids=groups[0].run_ids, adapter_path="/a/1")
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT val_reward, val_runs FROM training_steps"))).one()
        view = {
            r.step: (r.val_reward, r.val_runs)
            for r in await conn.execute(text("SELECT step, val_reward, val_runs FROM validation"))
        }
    assert (row.val_reward, row.val_runs) == ((0.25 + 1.0) / 2, 2)  # v0 and v1; vx spans two steps
    assert view == {0: ((0.25 + 1.0) / 2, 2), 1: (0.75, 1)}
    assert await step_scores(engine, "p") == {0: ((0.25 + 1.0) / 2, 2), 1: (0.75, 1)}
    assert await best_step(engine, "p") == 1  # step 0 (the base) has no checkpoint to keep
    assert await best_step(engine, "p", min_runs=2) is None

    # late rewards: the view moves on, the committed step keeps what it saw
    async with engine.begin() as conn:
        await conn.execute(update(Run).where(Run.id == "vc").values(status="validated"))
    async with engine.connect() as conn:
        late = (await conn.execute(text("SELECT val_reward, val_runs FROM validation WHERE step = 0"))).one()
        frozen = (await conn.execute(text("SELECT val_reward, val_runs FROM training_steps"))).one()
    assert (late.val_reward, late.val_runs) == ((0.25 + 1.0 + 0.0) / 3, 3)
    assert (frozen.val_reward, frozen.val_runs) == ((0.25 + 1.0) / 2, 2)


def test_pick_best() -> None:
    scores = {0: (0.9, 5), 1: (0.5, 5), 2: (0.75, 1), 3: (0.75, 4), 4: (0.25, 9)}
    assert pick_best(scores) == 3  # ties: the newest
    assert pick_best(scores, min_runs=5) == 1
    assert pick_best({0: (1.0, 3)}) is None and pick_best({}) is None
