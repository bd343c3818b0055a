"""The reads other parts need (HTTP query routes, the CLI, the proxy's startup), as plain dicts.

Every function returns JSON-ready values: times are ISO 8601 strings in UTC, JSON columns are
decoded. Reads run on whatever engine they are given (a read-only one is fine) except
`expire_runs`, the one maintenance write, which takes SQLite's write lock up front.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import Row, and_, exists, func, or_, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.db import connect_write
from rlproxy.storage.models import Completion, Run, RunStatus, TrainingStep

log = logging.getLogger(__name__)

RUNS = Run.__table__
COMPLETIONS = Completion.__table__
STEPS = TrainingStep.__table__
MAX_LIMIT = 1000


def _iso(v: Any) -> Any:
    if isinstance(v, datetime):
        if v.tzinfo is None:  # SQLite hands back naive datetimes; rlproxy writes UTC only
            v = v.replace(tzinfo=UTC)
        return v.astimezone(UTC).isoformat()
    return v


def _as_dict(row: Row[Any]) -> dict[str, Any]:
    return {k: _iso(v) for k, v in row._mapping.items()}


def _utc(v: datetime) -> datetime:
    return v if v.tzinfo is not None else v.replace(tzinfo=UTC)


def _encode_cursor(created_at: datetime, run_id: str) -> str:
    raw = orjson.dumps([_utc(created_at).isoformat(), run_id])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        ts, run_id = orjson.loads(raw)
        return datetime.fromisoformat(ts), str(run_id)
    except (ValueError, TypeError, binascii.Error, orjson.JSONDecodeError) as e:
        raise ValueError(f"invalid cursor: {cursor!r}") from e


def _n_completions() -> Any:
    """A correlated count of the run's completions."""
    return (
        select(func.count())
        .select_from(COMPLETIONS)
        .where(COMPLETIONS.c.run_id == RUNS.c.id)
        .scalar_subquery()
        .label("n_completions")
    )


def _ts(engine: AsyncEngine, dt: datetime) -> datetime:
    # SQLite stores naive UTC text; compare with naive UTC so that the text order is time order.
    dt = _utc(dt).astimezone(UTC)
    return dt.replace(tzinfo=None) if engine.dialect.name == "sqlite" else dt


async def list_runs(
    engine: AsyncEngine,
    *,
    status: str | None = None,
    group_id: str | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Runs newest first, `limit` at a time; pass the returned cursor to get the next page.

    The order is (created_at, id) descending, so pages are stable while new runs arrive: a cursor
    points below the last run returned, new runs only appear on page one. Raises ValueError for a
    cursor this function did not make.
    """
    limit = max(1, min(int(limit), MAX_LIMIT))
    q = select(RUNS, _n_completions()).order_by(RUNS.c.created_at.desc(), RUNS.c.id.desc()).limit(limit + 1)
    if status is not None:
        q = q.where(RUNS.c.status == status)
    if group_id is not None:
        q = q.where(RUNS.c.group_id == group_id)
    if cursor:
        ts, rid = _decode_cursor(cursor)
        ts_b = _ts(engine, ts)
        q = q.where(or_(RUNS.c.created_at < ts_b, and_(RUNS.c.created_at == ts_b, RUNS.c.id < rid)))
    async with engine.connect() as conn:
        rows = (await conn.execute(q)).all()
    nxt = None
    if len(rows) > limit:
        rows = rows[:limit]
        last = rows[-1]
        nxt = _encode_cursor(last.created_at, last.id)
    return [_as_dict(r) for r in rows], nxt


async def get_run(engine: AsyncEngine, run_id: str) -> dict[str, Any] | None:
    """A run with its completions (ordered by seq) and `messages`: its trajectory as the view has it."""
    async with engine.connect() as conn:
        run = (await conn.execute(select(RUNS, _n_completions()).where(RUNS.c.id == run_id))).first()
        if run is None:
            return None
        comps = (
            await conn.execute(
                select(COMPLETIONS).where(COMPLETIONS.c.run_id == run_id).order_by(COMPLETIONS.c.seq)
            )
        ).all()
        msgs = (
            await conn.execute(text("SELECT messages FROM trajectories WHERE run_id = :r"), {"r": run_id})
        ).scalar()
    out = _as_dict(run)
    out["completions"] = [_as_dict(c) for c in comps]
    if isinstance(msgs, str | bytes):
        msgs = orjson.loads(msgs)
    out["messages"] = msgs if msgs is not None else []
    return out


async def list_training_steps(
    engine: AsyncEngine, *, policy: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """The newest `limit` training steps (of `policy`, or of all policies), newest first."""
    limit = max(1, min(int(limit), MAX_LIMIT))
    q = select(STEPS).order_by(STEPS.c.finished_at.desc().nulls_last(), STEPS.c.id.desc()).limit(limit)
    if policy is not None:
        q = q.where(STEPS.c.policy == policy)
    async with engine.connect() as conn:
        return [_as_dict(r) for r in (await conn.execute(q)).all()]


async def latest_adapters(engine: AsyncEngine) -> dict[str, tuple[int, str]]:
    """policy -> (step, adapter_path) of its newest step with an adapter: what to re-load on start."""
    latest = (
        select(STEPS.c.policy, func.max(STEPS.c.step).label("step"))
        .where(STEPS.c.adapter_path.is_not(None))
        .group_by(STEPS.c.policy)
        .subquery()
    )
    q = select(STEPS.c.policy, STEPS.c.step, STEPS.c.adapter_path).join(
        latest, and_(STEPS.c.policy == latest.c.policy, STEPS.c.step == latest.c.step)
    )
    async with engine.connect() as conn:
        return {r.policy: (int(r.step), r.adapter_path) for r in (await conn.execute(q)).all()}


async def run_status_counts(engine: AsyncEngine) -> dict[str, int]:
    """Number of runs per status; every status is present (0 when none)."""
    async with engine.connect() as conn:
        rows = (await conn.execute(select(RUNS.c.status, func.count()).group_by(RUNS.c.status))).all()
    out = {s.value: 0 for s in RunStatus}
    out.update({status: int(n) for status, n in rows})
    return out


async def expire_runs(engine: AsyncEngine, older_than_s: float) -> int:
    """Mark `expired` the open runs with no completion in the last `older_than_s` seconds.

    Returns how many. A reward arriving later still lands (the writer revives an expired run).
    """
    cutoff = _ts(engine, datetime.now(UTC) - timedelta(seconds=float(older_than_s)))
    recent = exists().where(and_(COMPLETIONS.c.run_id == RUNS.c.id, COMPLETIONS.c.created_at >= cutoff))
    stmt = (
        update(RUNS)
        .where(RUNS.c.status == RunStatus.open.value, RUNS.c.created_at < cutoff, ~recent)
        .values(status=RunStatus.expired.value)
    )
    t0 = time.monotonic()
    conn = await connect_write(engine)
    try:
        async with conn.begin():
            n = (await conn.execute(stmt)).rowcount
    finally:
        await conn.close()
    if n:
        log.info("expired %d runs in %.1f ms", n, (time.monotonic() - t0) * 1000)
    return int(n or 0)
