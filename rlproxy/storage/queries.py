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
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Row, and_, exists, func, or_, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.db import connect_write, create_engine, is_sqlite, normalize_url, sqlite_path
from rlproxy.storage.errors import NotAStore
from rlproxy.storage.models import Completion, Rollout, RolloutStatus, Run, RunStatus, TrainingStep
from rlproxy.storage.times import aware, iso
from rlproxy.storage.training import STEP_COLUMNS
from rlproxy.storage.validation import best_step

log = logging.getLogger(__name__)

RUNS = Run.__table__
COMPLETIONS = Completion.__table__
STEPS = TrainingStep.__table__
MAX_LIMIT = 1000


def _as_dict(row: Row[Any]) -> dict[str, Any]:
    return {k: iso(v) for k, v in row._mapping.items()}


def _encode_cursor(created_at: datetime, run_id: str) -> str:
    raw = orjson.dumps([aware(created_at).isoformat(), run_id])
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
    dt = aware(dt).astimezone(UTC)
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
    """policy -> (step, adapter_path) of its newest step with an adapter, rolled-back steps left out (a
    canary's, or one the shadow check stopped before its checkpoint is deleted): what to re-load on
    start and what a replica's poll moves to."""
    rejected = exists().where(
        Rollout.policy == STEPS.c.policy,
        Rollout.candidate_step == STEPS.c.step,
        Rollout.status == RolloutStatus.rolled_back,
    )
    latest = (
        select(STEPS.c.policy, func.max(STEPS.c.step).label("step"))
        .where(STEPS.c.adapter_path.is_not(None), ~rejected)
        .group_by(STEPS.c.policy)
        .subquery()
    )
    q = select(STEPS.c.policy, STEPS.c.step, STEPS.c.adapter_path).join(
        latest, and_(STEPS.c.policy == latest.c.policy, STEPS.c.step == latest.c.step)
    )
    async with engine.connect() as conn:
        return {r.policy: (int(r.step), r.adapter_path) for r in (await conn.execute(q)).all()}


async def stored_response(engine: AsyncEngine, response_id: str) -> dict[str, Any] | None:
    """The stored Responses call with this `response_id`: its `run_id`, `status`, chat-form `request`
    and `response`, and the `client_response` the client got; None when no stored response has that id."""
    q = select(
        COMPLETIONS.c.run_id,
        COMPLETIONS.c.key_id,
        COMPLETIONS.c.status,
        COMPLETIONS.c.request,
        COMPLETIONS.c.response,
        COMPLETIONS.c.client_response,
    )
    async with engine.connect() as conn:
        row = (await conn.execute(q.where(COMPLETIONS.c.response_id == response_id))).first()
    return dict(row._mapping) if row is not None else None


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


# --- read-only access for the CLI and the read-only dashboard -------------------------------------

# The per-step metric columns (storage/training.py STEP_COLUMNS, their one owner), and where older rows
# (or a store before migration 0005) keep the same number in the step's `metrics` JSON.
STEP_METRICS: dict[str, tuple[str, ...]] = {c: (spec.metric, *spec.older) for c, spec in STEP_COLUMNS.items()}


def _shown(url: str) -> str:
    """The store as a user names it: a SQLite file's path, else the URL without its password."""
    try:
        u = make_url(normalize_url(url))
        if u.get_backend_name() == "sqlite":
            return sqlite_path(url) or url
        return u.render_as_string(hide_password=True)
    except Exception:  # a URL SQLAlchemy cannot parse: show it as given
        return url


def _first_line(exc: BaseException) -> str:
    text_ = str(getattr(exc, "orig", None) or exc).strip()
    return text_.splitlines()[0] if text_ else type(exc).__name__


async def open_readonly(
    url: str, *, statement_timeout_s: float | None = None, check: bool = True
) -> AsyncEngine:
    """A read-only engine on the store at `url`, checked to be an rlproxy store (`check=False`: any
    database, e.g. for `rlproxy sql`). Raises NotAStore with a sentence saying what is wrong."""
    shown = _shown(url)
    path = sqlite_path(url) if is_sqlite(url) else None
    if path is not None and Path(path).is_dir():
        raise NotAStore(f"{shown} is a folder, not a database file")
    try:
        engine = create_engine(url, readonly=True, statement_timeout_s=statement_timeout_s)
    except FileNotFoundError:
        raise NotAStore(
            f"no database at {shown} (`rlproxy db upgrade --db ...` creates one; so does `rlproxy serve`)"
        ) from None
    except Exception as exc:  # a URL SQLAlchemy cannot use: unknown dialect, malformed
        raise NotAStore(f"cannot open {shown}: {_first_line(exc)}") from None
    try:
        async with engine.connect() as conn:
            if not check:  # any database will do, but it must be one
                probe = (
                    "SELECT 1 FROM sqlite_master LIMIT 1" if engine.dialect.name == "sqlite" else "SELECT 1"
                )
                await conn.execute(text(probe))
                return engine
            try:
                await conn.execute(text("SELECT 1 FROM runs WHERE 1 = 0"))
                await conn.execute(text("SELECT version_num FROM alembic_version"))
            except Exception as exc:
                message = _first_line(exc)
                if "no such table" in message or "does not exist" in message:
                    raise NotAStore(
                        f"{shown} is not an rlproxy database (it has no `runs` table; "
                        "`rlproxy db upgrade --db ...` creates one)"
                    ) from None
                raise
    except NotAStore:
        await engine.dispose()
        raise
    except Exception as exc:  # not a database file, a server that refuses, bad credentials
        await engine.dispose()
        raise NotAStore(f"cannot read {shown}: {_first_line(exc)}") from None
    return engine


async def run_sql(engine: AsyncEngine, query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """(column names, rows) of one SQL statement, as the driver returns them (JSON columns as text)."""
    async with engine.connect() as conn:
        result = await conn.execute(text(query))
        if not result.returns_rows:
            return [], []
        return list(result.keys()), [tuple(r) for r in result.fetchall()]


async def step_table(
    engine: AsyncEngine, *, policy: str | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    """The newest `limit` training steps (of `policy`, or all), oldest first, as `rlproxy steps` shows them.

    Every row has `kind` and the metric columns of `STEP_METRICS` (None where unknown): read from the
    columns when the store has them, else from the step's `metrics` JSON; and `best`: True on the
    step whose adapter scored the best validation reward (storage/validation.py best_step).
    """
    limit = max(1, min(int(limit), MAX_LIMIT))
    where = "WHERE policy = :policy " if policy is not None else ""
    q = text(f"SELECT * FROM training_steps {where}ORDER BY finished_at DESC, id DESC LIMIT :limit")
    params: dict[str, Any] = {"limit": limit}
    if policy is not None:
        params["policy"] = policy
    async with engine.connect() as conn:
        rows = [dict(r._mapping) for r in (await conn.execute(q, params)).all()]
    best = {p: await best_step(engine, p) for p in {r["policy"] for r in rows}} if rows else {}
    out = []
    for row in reversed(rows):
        metrics = row.get("metrics")
        if isinstance(metrics, str | bytes):
            try:
                metrics = orjson.loads(metrics)
            except orjson.JSONDecodeError:
                metrics = None
        metrics = metrics if isinstance(metrics, dict) else {}
        for column, keys in STEP_METRICS.items():
            if row.get(column) is None:
                row[column] = next(
                    (metrics[k] for k in keys if isinstance(metrics.get(k), int | float)), None
                )
        row["kind"] = row.get("kind") or "grpo"
        row["best"] = best.get(row["policy"]) == row["step"]
        row["metrics"] = metrics
        row.pop("config", None)
        out.append({k: iso(v) for k, v in row.items()})
    return out


# --- closed runs (issue 22: proxy/runstate.py) ----------------------------------------------------

# the statuses of a run that has its reward (or asked for the judge's): it takes no more turns
CLOSED_STATUSES = tuple(s.value for s in RunStatus if s not in (RunStatus.open, RunStatus.expired))


def _closed() -> Any:
    return RUNS.c.reward.is_not(None) | RUNS.c.reward_source.is_not(None)


async def closed_runs(engine: AsyncEngine, run_ids: list[str]) -> set[str]:
    """Which of `run_ids` are closed: a reward or a judge request is stored for them (primary key reads)."""
    if not run_ids:
        return set()
    q = select(RUNS.c.id).where(RUNS.c.id.in_(run_ids), _closed())
    async with engine.connect() as conn:
        return set((await conn.execute(q)).scalars())


async def recently_closed(engine: AsyncEngine, limit: int) -> list[str]:
    """Ids of the `limit` runs closed most recently, newest first (a replica's start: proxy/runstate.py)."""
    q = (
        select(RUNS.c.id)
        .where(RUNS.c.status.in_(CLOSED_STATUSES), _closed())
        .order_by(RUNS.c.completed_at.desc())
        .limit(limit)
    )
    async with engine.connect() as conn:
        return list((await conn.execute(q)).scalars())


async def closed_since(engine: AsyncEngine, since: datetime, limit: int = 100_000) -> list[str]:
    """Ids of the runs rewarded (or completed for the judge) at or after `since`, on any replica
    (`ix_runs_status_completed`: one range per closed status)."""
    q = (
        select(RUNS.c.id)
        .where(RUNS.c.status.in_(CLOSED_STATUSES), RUNS.c.completed_at >= _ts(engine, since), _closed())
        .limit(limit)
    )
    async with engine.connect() as conn:
        return list((await conn.execute(q)).scalars())
