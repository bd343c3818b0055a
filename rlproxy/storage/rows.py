"""The rows one writer transaction writes: new runs, completions with their `seq`, rewards.

Plain async functions on a connection inside the writer's open transaction; the writer
(`writer.py`) owns the queue, the batching, the retries and the transaction itself, so nothing here
commits. `next_seq` is the writer's map run id -> next `seq`, read here for runs it has not seen.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rlproxy.storage.errors import RewardConflict, RunNotFound
from rlproxy.storage.models import Completion, Run, RunStatus
from rlproxy.storage.records import COMPLETION_FIELDS, CompletionRecord

RUNS = Run.__table__
COMPLETIONS = Completion.__table__


async def stored_capture_ids(conn: AsyncConnection, capture_ids: list[str]) -> set[str]:
    """Which of `capture_ids` are stored already (a replayed journal record is stored once)."""
    query = select(COMPLETIONS.c.capture_id).where(COMPLETIONS.c.capture_id.in_(capture_ids))
    return set((await conn.execute(query)).scalars())


async def ensure_runs(
    conn: AsyncConnection, records: list[CompletionRecord], next_seq: dict[str, int]
) -> None:
    """Read next seq of runs not seen yet, and create the rows of runs that are new."""
    first: dict[str, CompletionRecord] = {}
    for rec in records:
        if rec.run_id is not None and rec.run_id not in next_seq and rec.run_id not in first:
            first[rec.run_id] = rec
    if not first:
        return
    ids = list(first)
    existing = set((await conn.execute(select(RUNS.c.id).where(RUNS.c.id.in_(ids)))).scalars())
    max_seq = dict(
        (
            await conn.execute(
                select(COMPLETIONS.c.run_id, func.max(COMPLETIONS.c.seq))
                .where(COMPLETIONS.c.run_id.in_(ids))
                .group_by(COMPLETIONS.c.run_id)
            )
        ).all()
    )
    new = [
        {
            "id": rid,
            "group_id": rec.group_id or rec.default_group,
            "policy": rec.policy,
            "status": RunStatus.open.value,
            "created_at": rec.created_at or datetime.now(UTC),
        }
        for rid, rec in first.items()
        if rid not in existing
    ]
    if new:
        await conn.execute(insert(RUNS), new)
    for rid in ids:
        m = max_seq.get(rid)
        next_seq[rid] = 0 if m is None else int(m) + 1


async def insert_completions(
    conn: AsyncConnection, records: list[CompletionRecord], next_seq: dict[str, int], now: datetime
) -> int:
    """Insert `records` as `completions` rows, numbering each run's rows on; returns the rows written."""
    rows = []
    for rec in records:
        row = {f: getattr(rec, f) for f in COMPLETION_FIELDS}
        row["created_at"] = rec.created_at or now
        if rec.run_id is not None:
            row["seq"] = next_seq[rec.run_id]
            next_seq[rec.run_id] += 1
        else:
            row["seq"] = None
        rows.append(row)
    if rows:
        await conn.execute(insert(COMPLETIONS), rows)
    return len(rows)


async def apply_reward(
    conn: AsyncConnection,
    run_id: str,
    reward: float,
    metrics: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
    now: datetime,
) -> bool | RunNotFound | RewardConflict:
    """Store a run's reward: True when stored, False when the same one was, else the error to raise."""
    row = (await conn.execute(select(RUNS.c.reward, RUNS.c.status).where(RUNS.c.id == run_id))).first()
    if row is None:
        return RunNotFound(run_id)
    if row.reward is not None:
        if float(row.reward) == reward:
            return False
        return RewardConflict(run_id, row.reward, reward)
    # A late reward revives an expired run; a run the trainer already judged keeps its status.
    status = RunStatus.completed.value if row.status in (RunStatus.open, RunStatus.expired) else row.status
    await conn.execute(
        update(RUNS)
        .where(RUNS.c.id == run_id)
        .values(reward=reward, metrics=metrics, metadata=metadata, completed_at=now, status=status)
    )
    return True
