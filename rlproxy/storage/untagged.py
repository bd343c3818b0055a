"""Untagged traffic: completions stored without a run key, listed, counted, and adopted into a run.

A request with no `X-Run-Id` (and no `/runs/{id}/v1` base URL) is forwarded and stored with
`run_id` NULL: the view `untagged` (migration 0014) lists those rows with the `id` the client got in
its response (`reply_id`). An app that sets no header can still reward what it got: the reward route
for a reply (proxy/routes_untagged.py) makes the reply a run of its own, named by the reply id
(`adopt`), then stores the reward exactly as `POST /v1/runs/{id}/reward` does. The reply id is the
capability: only the client that got the response holds it (as a run id is for a tagged run).

`adopt` is a short write transaction of its own on the proxy's engine (as `queries.expire_runs` is),
not a writer batch: the completion is already committed when it is found, and the reward that
follows goes through the one writer like any reward.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, insert, or_, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.db import connect_write
from rlproxy.storage.models import Completion, Run, RunStatus
from rlproxy.storage.times import iso

RUNS = Run.__table__
COMPLETIONS = Completion.__table__
UNTAGGED_COLUMNS = (
    "completion_id",
    "reply_id",
    "created_at",
    "policy",
    "policy_step",
    "endpoint",
    "status",
    "status_code",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "latency_ms",
)


def _reply_id_expr() -> Any:
    """The id the client got: a Responses/Messages object's, else the chat/completions response's."""
    return func.coalesce(
        COMPLETIONS.c.response_id,
        COMPLETIONS.c.client_response["id"].as_string(),
        COMPLETIONS.c.response["id"].as_string(),
    )


async def count_untagged(engine: AsyncEngine) -> int:
    """How many completions carry no run key."""
    async with engine.connect() as conn:
        n = await conn.scalar(
            select(func.count()).select_from(COMPLETIONS).where(COMPLETIONS.c.run_id.is_(None))
        )
    return int(n or 0)


async def list_untagged(
    engine: AsyncEngine, *, limit: int = 50, before: int | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """The newest untagged completions (the `untagged` view), `limit` at a time, newest first.

    Returns (rows, next): pass `next` back as `before` for the next page (None: no more).
    """
    limit = max(1, min(int(limit), 1000))
    sql = "SELECT * FROM untagged" + (" WHERE completion_id < :before" if before is not None else "")
    sql += " ORDER BY completion_id DESC LIMIT :n"
    async with engine.connect() as conn:
        rows = (await conn.execute(text(sql), {"before": before, "n": limit + 1})).mappings().all()
    out = [{c: r.get(c) for c in UNTAGGED_COLUMNS} for r in rows[:limit]]
    for row in out:
        row["created_at"] = iso(row["created_at"], text=True)  # SQLite: the view's text
    nxt = out[-1]["completion_id"] if len(rows) > limit else None
    return out, nxt


async def find_reply(
    engine: AsyncEngine, reply_id: str, key_id: str | None = None, run_name: str | None = None
) -> dict[str, Any] | None:
    """The completion of key `key_id` (None: the shared agents' key) whose response carried
    `reply_id`, untagged or adopted as run `run_name` (default: `reply_id`), or None.

    Returns its `id`, `run_id` (None: untagged), `policy`, `request` and `created_at`. A reply of a
    tagged run is returned too (its `run_id` is that run's), so the caller can refuse it; an id that
    several untagged replies of the key carried (an upstream that repeats its ids) is returned as
    `{"ambiguous": True}`: never one of them picked.
    """
    run_name = reply_id if run_name is None else run_name
    mine = COMPLETIONS.c.key_id.is_(None) if key_id is None else COMPLETIONS.c.key_id == key_id
    query = (
        select(
            COMPLETIONS.c.id,
            COMPLETIONS.c.run_id,
            COMPLETIONS.c.policy,
            COMPLETIONS.c.request,
            COMPLETIONS.c.created_at,
        )
        .where(_reply_id_expr() == reply_id, mine)
        .where(or_(COMPLETIONS.c.run_id.is_(None), COMPLETIONS.c.run_id == run_name))
        .order_by(COMPLETIONS.c.id)
        .limit(3)
    )
    async with engine.connect() as conn:
        rows = [dict(r) for r in (await conn.execute(query)).mappings().all()]
        if not rows:  # a tagged run's reply: say so without naming the run
            tagged = await conn.scalar(
                select(COMPLETIONS.c.id).where(_reply_id_expr() == reply_id, mine).limit(1)
            )
            return {"id": tagged, "run_id": "", "tagged": True} if tagged is not None else None
    adopted = [r for r in rows if r["run_id"] == run_name]
    if adopted:
        return adopted[0]
    return rows[0] if len(rows) == 1 else {"ambiguous": True}


class _Lost(Exception):
    """The completion joined another run between the check and the update: roll the new run back."""


async def adopt(
    engine: AsyncEngine,
    completion_id: int,
    run_id: str,
    *,
    policy: str | None,
    group_id: str,
    created_at: datetime | None = None,
    key_id: str | None = None,
) -> bool:
    """Make untagged completion `completion_id` the first (seq 0) call of a new run `run_id`.

    True when adopted now or already (the same completion is that run's); False when `run_id` is
    another run's name (a tagged run took the name) or the completion joined another run meanwhile.
    """
    conn = await connect_write(engine)
    try:
        return await _adopt(
            conn, completion_id, run_id, policy, group_id, created_at or datetime.now(UTC), key_id
        )
    except _Lost:
        return False
    finally:
        await conn.close()


async def _adopt(
    conn: Any,
    completion_id: int,
    run_id: str,
    policy: str | None,
    group_id: str,
    created_at: datetime,
    key_id: str | None = None,
) -> bool:
    """One transaction: the new run row and the completion's move commit together, or neither."""
    async with conn.begin():
        owner = await conn.scalar(select(COMPLETIONS.c.run_id).where(COMPLETIONS.c.id == completion_id))
        if owner == run_id:
            return True
        if owner is not None:
            return False
        try:
            async with conn.begin_nested():
                await conn.execute(
                    insert(RUNS).values(
                        id=run_id,
                        group_id=group_id,
                        split="train",
                        policy=policy,
                        status=RunStatus.open.value,
                        created_at=created_at,
                        next_seq=1,
                        key_id=key_id,
                    )
                )
        except IntegrityError:
            return False  # a run of that name exists (and does not hold this completion)
        done = await conn.execute(
            update(COMPLETIONS)
            .where(COMPLETIONS.c.id == completion_id, COMPLETIONS.c.run_id.is_(None))
            .values(run_id=run_id, seq=0)
        )
        if not done.rowcount:
            raise _Lost
        return True
