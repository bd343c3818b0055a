"""The trainer's queries: which groups are ready, what they hold, and committing a step exactly once.

A *group* is the completed runs sharing (policy, group_id). It is ready when it holds `group_size`
completed runs, or when its newest reward is older than `group_timeout` and it holds at least two.
Groups whose rewards are all equal carry no gradient: `skip_groups` marks their runs `skipped`.

`commit_step` is the exactly-once point: in ONE write transaction (SQLite: BEGIN IMMEDIATE) it sets
the step's runs to `trained` only if every one is still `completed`, and inserts the
`training_steps` row; anything else rolls back and raises `StepConflict`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rlproxy.storage.db import connect_write
from rlproxy.storage.errors import StepConflict
from rlproxy.storage.models import Completion, Run, RunStatus, TrainingStep

log = logging.getLogger(__name__)


@dataclass
class ReadyGroup:
    """A group of completed runs ready for training, oldest reward first."""

    policy: str
    group_id: str
    run_ids: list[str]
    rewards: list[float]
    newest_at: datetime

    @property
    def zero_variance(self) -> bool:
        """All rewards equal: the group-normalized advantages are all zero, no gradient."""
        return max(self.rewards) - min(self.rewards) < 1e-9


@dataclass
class CompletionData:
    """One stored model call of a run, as the trainer needs it."""

    run_id: str
    seq: int
    policy_step: int | None
    endpoint: str | None
    request: dict[str, Any] | None
    response: dict[str, Any] | None
    prompt_token_ids: list[int] | list[list[int] | None] | None  # one per choice: a batched /v1/completions
    token_ids: list[list[int] | None] | None  # one list per choice
    logprobs: list[list[float | None] | None] | None  # one list per choice
    status: str | None = None  # ok, error, cancelled


@dataclass
class RunData:
    """A run of a ready group with its reward and completions (ordered by seq)."""

    run_id: str
    group_id: str
    policy: str
    reward: float
    completions: list[CompletionData] = field(default_factory=list)


@asynccontextmanager
async def _write(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One write transaction holding SQLite's write lock from its start (BEGIN IMMEDIATE)."""
    conn = await connect_write(engine)
    try:
        async with conn.begin():  # raising inside rolls everything back
            yield conn
    finally:
        await conn.close()


def _aware(t: datetime | None) -> datetime | None:
    # SQLite hands timezone-aware columns back naive; they were written as UTC.
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t


async def ready_groups(
    engine: AsyncEngine,
    *,
    group_size: int,
    group_timeout: float,
    now: datetime | None = None,
    policy: str | None = None,
) -> list[ReadyGroup]:
    """Every ready group (optionally of one policy), the one waiting longest first."""
    now = now or datetime.now(UTC)
    newest = func.max(func.coalesce(Run.completed_at, Run.created_at))
    q = (
        select(Run.policy, Run.group_id, func.count().label("n"), newest.label("newest"))
        .where(Run.status == RunStatus.completed, Run.group_id.is_not(None), Run.policy.is_not(None))
        .where(Run.reward.is_not(None))
        .group_by(Run.policy, Run.group_id)
        .having(func.count() >= 2)
    )
    if policy is not None:
        q = q.where(Run.policy == policy)
    async with engine.connect() as conn:
        rows = (await conn.execute(q)).all()
        cutoff = now - timedelta(seconds=group_timeout)
        keys = [
            (r.policy, r.group_id, _aware(r.newest))
            for r in rows
            if r.n >= group_size or (_aware(r.newest) is not None and _aware(r.newest) <= cutoff)
        ]
        groups = []
        for pol, gid, newest_at in keys:
            runs = (
                await conn.execute(
                    select(Run.id, Run.reward)
                    .where(Run.policy == pol, Run.group_id == gid, Run.status == RunStatus.completed)
                    .where(Run.reward.is_not(None))
                    .order_by(Run.completed_at, Run.id)
                )
            ).all()
            groups.append(
                ReadyGroup(pol, gid, [r.id for r in runs], [float(r.reward) for r in runs], newest_at)
            )
    groups.sort(key=lambda g: g.newest_at)
    return groups


async def load_runs(engine: AsyncEngine, run_ids: list[str]) -> list[RunData]:
    """The runs `run_ids` with their completions, in the order given."""
    async with engine.connect() as conn:
        runs = {r.id: r for r in (await conn.execute(select(Run).where(Run.id.in_(run_ids)))).all()}
        comps = (
            await conn.execute(
                select(Completion)
                .where(Completion.run_id.in_(run_ids))
                .order_by(Completion.run_id, Completion.seq)
            )
        ).all()
    out = {
        rid: RunData(rid, runs[rid].group_id, runs[rid].policy, float(runs[rid].reward))
        for rid in run_ids
        if rid in runs
    }
    for c in comps:
        out[c.run_id].completions.append(
            CompletionData(
                run_id=c.run_id,
                seq=c.seq if c.seq is not None else 0,
                policy_step=c.policy_step,
                endpoint=c.endpoint,
                request=c.request,
                response=c.response,
                prompt_token_ids=c.prompt_token_ids,
                token_ids=c.token_ids,
                logprobs=c.logprobs,
                status=c.status,
            )
        )
    return [out[rid] for rid in run_ids if rid in out]


async def mark_runs(engine: AsyncEngine, run_ids: list[str], status: RunStatus) -> int:
    """Set still-`completed` runs to `status` (skipped or failed); returns how many changed."""
    if not run_ids:
        return 0
    async with _write(engine) as conn:
        res = await conn.execute(
            update(Run).where(Run.id.in_(run_ids), Run.status == RunStatus.completed).values(status=status)
        )
    return res.rowcount


async def skip_groups(engine: AsyncEngine, groups: list[ReadyGroup]) -> int:
    """Mark the runs of zero-variance groups `skipped` (no gradient, never trained); returns the run count."""
    return await mark_runs(engine, [rid for g in groups for rid in g.run_ids], RunStatus.skipped)


async def commit_step(
    engine: AsyncEngine,
    *,
    policy: str,
    step: int,
    run_ids: list[str],
    adapter_path: str | None,
    started_at: datetime | None = None,
    finished_at: datetime | None = None,
    num_groups: int | None = None,
    num_tokens: int | None = None,
    mean_reward: float | None = None,
    loss: float | None = None,
    metrics: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> None:
    """Record step `step` of `policy` and mark its runs `trained`, all or nothing.

    Raises StepConflict (and changes nothing) when a run is not `completed` any more (already
    trained by this step or another, skipped, ...) or when the step is already recorded.
    """
    run_ids = list(dict.fromkeys(run_ids))
    async with _write(engine) as conn:
        exists = await conn.scalar(
            select(func.count())
            .select_from(TrainingStep)
            .where(TrainingStep.policy == policy, TrainingStep.step == step)
        )
        if exists:
            raise StepConflict(f"step {step} of policy {policy!r} is already recorded")
        res = await conn.execute(
            update(Run)
            .where(Run.id.in_(run_ids), Run.status == RunStatus.completed)
            .values(status=RunStatus.trained, trained_step=step)
        )
        if res.rowcount != len(run_ids):
            raise StepConflict(
                f"step {step} of policy {policy!r}: {len(run_ids) - res.rowcount} of {len(run_ids)} runs "
                "are no longer completed (trained or skipped elsewhere); nothing was committed"
            )
        await conn.execute(
            insert(TrainingStep).values(
                step=step,
                policy=policy,
                adapter_path=adapter_path,
                started_at=started_at,
                finished_at=finished_at or datetime.now(UTC),
                num_groups=num_groups,
                num_runs=len(run_ids),
                num_tokens=num_tokens,
                mean_reward=mean_reward,
                loss=loss,
                metrics=metrics,
                config=config,
            )
        )
    log.debug("committed step %d of %s (%d runs)", step, policy, len(run_ids))


async def latest_step(engine: AsyncEngine, policy: str) -> int:
    """The newest recorded step of `policy`; 0 when it has none (the base model)."""
    async with engine.connect() as conn:
        step = await conn.scalar(select(func.max(TrainingStep.step)).where(TrainingStep.policy == policy))
    return int(step or 0)


async def step_exists(engine: AsyncEngine, policy: str, step: int) -> bool:
    """True when `training_steps` holds step `step` of `policy`."""
    async with engine.connect() as conn:
        n = await conn.scalar(
            select(func.count())
            .select_from(TrainingStep)
            .where(TrainingStep.policy == policy, TrainingStep.step == step)
        )
    return bool(n)
