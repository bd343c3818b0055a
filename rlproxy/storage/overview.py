"""The reads the dashboard digs in with: runs under filters (with a total, for paging) and the reward
of every group over time, the skipped ones included.

`find_runs` is `queries.list_runs` with every filter a user reaches for (status, policy, group,
split, reward range, time range, an id substring) and offset paging with a total count, for an
operator's page (not the agents' cursor API). `group_rewards` is one row per rewarded group of the
training split: when its last run was rewarded, its mean and spread, how many runs, and what became
of it (`trained` at step N, `skipped` with its reason, or still waiting) — the curve of what the
app's rewards did, whether or not a training step ever came of it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, case, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.models import Completion, Run

RUNS = Run.__table__
COMPLETIONS = Completion.__table__
MAX_LIMIT = 1000


def _iso(v: Any) -> Any:
    """A time as ISO 8601 in UTC (an aggregate over SQLite hands back its naive UTC text)."""
    if isinstance(v, str) and len(v) >= 19 and v[4] == "-" and v[10] in " T":
        try:
            v = datetime.fromisoformat(v)
        except ValueError:
            return v
    if isinstance(v, datetime):
        v = v if v.tzinfo is not None else v.replace(tzinfo=UTC)
        return v.astimezone(UTC).isoformat()
    return v


def _when(engine: AsyncEngine, v: datetime) -> datetime:
    """A bound for a time column: SQLite compares naive UTC text, PostgreSQL aware datetimes."""
    v = v if v.tzinfo is not None else v.replace(tzinfo=UTC)
    v = v.astimezone(UTC)
    return v.replace(tzinfo=None) if engine.dialect.name == "sqlite" else v


async def find_runs(
    engine: AsyncEngine,
    *,
    status: str | None = None,
    policy: str | None = None,
    group_id: str | None = None,
    split: str | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    q: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[dict[str, Any]], int]:
    """Runs newest first under every filter given (None: no filter), and how many match in all.

    `since`/`until` bound `created_at`; `q` is a substring of the run id (case-sensitive).
    """
    limit = max(1, min(int(limit), MAX_LIMIT))
    conds = []
    for column, value in (
        (RUNS.c.status, status),
        (RUNS.c.policy, policy),
        (RUNS.c.group_id, group_id),
        (RUNS.c.split, split),
    ):
        if value is not None:
            conds.append(column == value)
    if min_reward is not None:
        conds.append(RUNS.c.reward >= min_reward)
    if max_reward is not None:
        conds.append(RUNS.c.reward <= max_reward)
    if since is not None:
        conds.append(RUNS.c.created_at >= _when(engine, since))
    if until is not None:
        conds.append(RUNS.c.created_at <= _when(engine, until))
    if q:
        conds.append(
            func.instr(RUNS.c.id, q) > 0 if engine.dialect.name == "sqlite" else RUNS.c.id.contains(q)
        )
    where = and_(True, *conds)
    n_completions = (
        select(func.count())
        .select_from(COMPLETIONS)
        .where(COMPLETIONS.c.run_id == RUNS.c.id)
        .scalar_subquery()
        .label("n_completions")
    )
    page = (
        select(RUNS, n_completions)
        .where(where)
        .order_by(RUNS.c.created_at.desc(), RUNS.c.id.desc())
        .limit(limit)
        .offset(max(0, int(offset)))
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(page)).mappings().all()
        total = await conn.scalar(select(func.count()).select_from(RUNS).where(where))
    return [{str(k): _iso(v) for k, v in r.items() if k != "next_seq"} for r in rows], int(total or 0)


async def group_rewards(
    engine: AsyncEngine, *, policy: str | None = None, limit: int = 1000
) -> list[dict[str, Any]]:
    """The newest `limit` rewarded groups of the training split, oldest first (one row per group and
    policy): `at` (its last reward), `runs`, `mean_reward`, `min_reward`, `max_reward`, `trained_step`
    (the newest step that trained one of its runs, else None), and `outcome`: trained, skipped (all
    rewards equal, or otherwise not trainable: `reason` says why), or waiting (not trained yet)."""
    trained = func.sum(case((RUNS.c.status == "trained", 1), else_=0))
    skipped = func.sum(case((RUNS.c.status.in_(("skipped", "failed")), 1), else_=0))
    query = (
        select(
            RUNS.c.group_id,
            RUNS.c.policy,
            func.max(RUNS.c.completed_at).label("at"),
            func.count().label("runs"),
            func.avg(RUNS.c.reward).label("mean_reward"),
            func.min(RUNS.c.reward).label("min_reward"),
            func.max(RUNS.c.reward).label("max_reward"),
            func.max(RUNS.c.trained_step).label("trained_step"),
            trained.label("n_trained"),
            skipped.label("n_skipped"),
            func.max(RUNS.c.status_reason).label("reason"),
        )
        .where(RUNS.c.reward.is_not(None), RUNS.c.split == "train", RUNS.c.completed_at.is_not(None))
        .group_by(RUNS.c.group_id, RUNS.c.policy)
        .order_by(func.max(RUNS.c.completed_at).desc())
        .limit(max(1, min(int(limit), 10_000)))
    )
    if policy is not None:
        query = query.where(RUNS.c.policy == policy)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    out = []
    for r in reversed(rows):
        outcome = "trained" if r["n_trained"] else ("skipped" if r["n_skipped"] else "waiting")
        out.append(
            {
                "group_id": r["group_id"],
                "policy": r["policy"],
                "at": _iso(r["at"]),
                "runs": int(r["runs"]),
                "mean_reward": float(r["mean_reward"]),
                "min_reward": float(r["min_reward"]),
                "max_reward": float(r["max_reward"]),
                "trained_step": r["trained_step"],
                "outcome": outcome,
                "reason": r["reason"] if outcome == "skipped" else None,
            }
        )
    return out


async def fullest_waiting_group(engine: AsyncEngine) -> tuple[str, str, int] | None:
    """(policy, group_id, rewarded runs) of the group of rewarded, untrained training runs that holds
    the most (the newest on a tie): what the trainer waits on. None when no run waits."""
    n = func.count().label("n")
    query = (
        select(RUNS.c.policy, RUNS.c.group_id, n)
        .where(RUNS.c.status == "completed", RUNS.c.reward.is_not(None), RUNS.c.split == "train")
        .where(RUNS.c.group_id.is_not(None))
        .group_by(RUNS.c.policy, RUNS.c.group_id)
        .order_by(n.desc(), func.max(RUNS.c.completed_at).desc())
        .limit(1)
    )
    async with engine.connect() as conn:
        row = (await conn.execute(query)).first()
    return (row.policy, row.group_id, int(row.n)) if row is not None else None
