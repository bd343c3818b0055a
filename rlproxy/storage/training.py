"""The trainer's queries: which groups are ready, what they hold, and committing a step exactly once.

A *group* is the completed runs sharing (policy, group_id). It is ready when it holds `group_size`
completed runs, or when its newest reward is older than `group_timeout` and it holds at least two.
Groups whose rewards are all equal carry no gradient: `skip_groups` marks their runs `skipped`.

Live traffic rarely repeats a task: most groups never get a second run. `ungroup_runs` moves a run
still alone in its group `group_timeout` after its reward to `ungrouped` (status_reason `no_sibling`),
so nothing stays `completed` forever and the poll only ever reads completed runs younger than a
timeout plus the groups waiting for a step. With `singletons=train`, `ungrouped_batch` hands the
oldest ungrouped runs of one policy to the trainer as one batch that shares one baseline (its mean
reward). Every read here starts from a status on `ix_runs_status_completed (status, completed_at,
id)` or `ix_runs_status_group`, so the poll's cost does not grow with the number of ungrouped,
trained or skipped runs (bench/poll.py measures it). `runs.status_reason` says why the trainer gave a
run its status (`StatusReason`).

`commit_step` is the exactly-once point: in ONE write transaction (SQLite: BEGIN IMMEDIATE) it sets
the step's runs to `trained` only if every one is still `completed` (or `ungrouped`), and inserts the
`training_steps` row; anything else rolls back and raises `StepConflict`.

(Over 400 lines: the selection of groups and the exactly-once commit are one contract over the same
statuses and indexes; the column list is `step_columns.py`, judging `judging.py`, siblings
`siblings.py`.)
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import exists, func, insert, literal_column, select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import aliased

from rlproxy.storage.db import write_transaction as _write  # judging, too
from rlproxy.storage.errors import StepConflict
from rlproxy.storage.models import Completion, Run, RunStatus, TrainingStep
from rlproxy.storage.step_columns import STEP_COLUMNS as STEP_COLUMNS  # re-exported: queries, trainer
from rlproxy.storage.step_columns import STEP_METRIC_COLUMNS
from rlproxy.storage.step_columns import step_columns as step_columns  # re-exported: the trainer
from rlproxy.storage.times import aware as _aware  # judging, too
from rlproxy.storage.validation import step_summary

log = logging.getLogger(__name__)


TRAINABLE = (RunStatus.completed, RunStatus.ungrouped)  # the statuses a step may take runs from
# Validation runs (split val) become `validated`, never a TRAINABLE status; this guard keeps them out
# of every selection even when a status was set by hand (storage/validation.py).
TRAIN_SPLIT = Run.split == "train"
# Who gave a run its reward (app, judge): groups and ungrouped batches are kept apart by it, so app
# rewards and judge scores never share one baseline (issue 22; NULL on rows older than the column)
SOURCE = func.coalesce(Run.reward_source, "app")
SIBLING = "sibling"  # reward_source of a sibling group's members (storage/siblings.py)
NOTICE_MIN_RUNS = 20  # fewer rewarded runs are too few to say that most tasks are unique


class StatusReason(enum.StrEnum):
    """`runs.status_reason`: why the trainer gave a run its status."""

    no_sibling = "no_sibling"  # ungrouped: no other rewarded run of its group within group_timeout
    zero_variance = "zero_variance"  # skipped: its group's (or batch's) rewards were all equal
    stale = "stale"  # skipped: every sample was drawn more than max_policy_lag steps ago
    no_usable_completion = "no_usable_completion"  # failed: nothing sampled was stored
    nonfinite = "nonfinite"  # failed: its steps' loss or gradient was not finite, again and again
    judge_failed = "judge_failed"  # failed: the judge's answers for its group stayed malformed (judging.py)
    judge_off = "judge_off"  # failed: completed for the judge, but the judge is off for its policy
    scorer_failed = "scorer_failed"  # failed: a sibling group's scorer failed scorer_max_attempts times
    hosted = "hosted"  # skipped: a hosted (text-only) upstream answered it: SFT data, never a GRPO sample
    imported = "imported"  # skipped: imported from a trace file (rlproxy import): text only, SFT data


@dataclass
class ReadyGroup:
    """A group of completed runs ready for training, oldest reward first.

    `batch` marks a batch of `ungrouped` runs (singletons=train): groups of one run each, trained
    against one shared baseline, the batch's mean reward.
    """

    policy: str
    group_id: str
    run_ids: list[str]
    rewards: list[float]
    newest_at: datetime
    batch: bool = False
    sources: list[str | None] = field(default_factory=list)  # runs.reward_source per run: app, judge

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
    source: str | None = None  # "hosted": a text-only upstream answered (no token ids; migration 0012)


@dataclass
class RunData:
    """A run of a ready group with its reward and completions (ordered by seq)."""

    run_id: str
    group_id: str
    policy: str
    reward: float
    completions: list[CompletionData] = field(default_factory=list)
    ungrouped: bool = False  # alone in its group: its baseline is its batch's (batches.baseline_group)
    sibling: bool = False  # a member of a sibling group (runs.branch_of set)
    weight: float = 1.0  # its advantage's multiplier in a step (a sibling's: siblings_weight)


def group_ready(n: int, newest: datetime | None, group_size: int, cutoff: datetime) -> bool:
    """A group is ready when it holds `group_size` runs, or its newest run is older than `cutoff`
    (now - group_timeout: it waited long enough for the rest)."""
    at = _aware(newest)
    return n >= group_size or (at is not None and at <= cutoff)


def _status_is(engine: AsyncEngine, status: RunStatus) -> Any:
    """`runs.status = status`, marked rare for SQLite's planner so that it walks a status index.

    Without per-value statistics (SQLite is built without STAT4), an ANALYZEd SQLite believes each
    status holds half the runs and scans the whole table instead; likelihood() overrides that
    estimate and keeps the term indexable. PostgreSQL's statistics know each status's share.
    """
    cond = Run.status == status
    return func.likelihood(cond, literal_column("0.001")) if engine.dialect.name == "sqlite" else cond


def _ts(engine: AsyncEngine, t: datetime) -> datetime:
    # SQLite stores naive UTC text: a bound time must be naive UTC too, so that text order is time order.
    t = t.astimezone(UTC) if t.tzinfo is not None else t
    return t.replace(tzinfo=None) if engine.dialect.name == "sqlite" else t.replace(tzinfo=UTC)


async def ready_groups(
    engine: AsyncEngine,
    *,
    group_size: int,
    group_timeout: float,
    now: datetime | None = None,
    policy: str | None = None,
) -> list[ReadyGroup]:
    """Every ready group (optionally of one policy), the one waiting longest first.

    A sibling group (reward_source 'sibling', storage/siblings.py) is ready as soon as it is scored,
    whatever `group_size`: its members are written and scored at once, no run of it is still coming.
    """
    now = now or datetime.now(UTC)
    newest = func.max(func.coalesce(Run.completed_at, Run.created_at))
    q = (
        select(
            Run.policy, Run.group_id, SOURCE.label("source"), func.count().label("n"), newest.label("newest")
        )
        .where(_status_is(engine, RunStatus.completed), Run.group_id.is_not(None), Run.policy.is_not(None))
        .where(Run.reward.is_not(None), TRAIN_SPLIT)
        .group_by(Run.policy, Run.group_id, SOURCE)
        .having(func.count() >= 2)
    )
    if policy is not None:
        q = q.where(Run.policy == policy)
    async with engine.connect() as conn:
        rows = (await conn.execute(q)).all()
        cutoff = now - timedelta(seconds=group_timeout)
        keys = [
            (r.policy, r.group_id, r.source, _aware(r.newest))
            for r in rows
            # a scored sibling group: every member was written and scored at once
            if r.source == SIBLING or group_ready(r.n, r.newest, group_size, cutoff)
        ]
        # one (policy, group) per poll, its longest waiting source first: a step's baseline is keyed by
        # the group id (trainer/batches.py), so its app and judge runs must not be in one step
        keys.sort(key=lambda k: k[3] or now)
        seen: set[tuple[str, str]] = set()
        groups = []
        for pol, gid, src, newest_at in keys:
            if (pol, gid) in seen:
                continue
            seen.add((pol, gid))
            runs = (
                await conn.execute(
                    select(Run.id, Run.reward, Run.reward_source)
                    .where(Run.policy == pol, Run.group_id == gid, Run.status == RunStatus.completed)
                    .where(Run.reward.is_not(None), TRAIN_SPLIT, SOURCE == src)
                    .order_by(Run.completed_at, Run.id)
                )
            ).all()
            groups.append(
                ReadyGroup(
                    pol,
                    gid,
                    [r.id for r in runs],
                    [float(r.reward) for r in runs],
                    newest_at,
                    sources=[r.reward_source for r in runs],
                )
            )
    groups.sort(key=lambda g: g.newest_at)
    return groups


def _alone() -> Any:
    """True for a run that no other rewarded `completed` run shares (policy, group_id) with."""
    sib = aliased(Run)
    return ~exists().where(
        sib.status == RunStatus.completed,
        sib.policy == Run.policy,
        sib.group_id == Run.group_id,
        sib.reward.is_not(None),
        func.coalesce(sib.reward_source, "app") == SOURCE,
        sib.id != Run.id,
    )


async def ungroup_runs(engine: AsyncEngine, *, group_timeout: float, now: datetime | None = None) -> int:
    """Mark `ungrouped` (reason `no_sibling`) every rewarded `completed` run still alone in its group
    `group_timeout` seconds after its reward; returns how many.

    It reads first and takes the write lock only when there is something to move. The read walks
    ix_runs_status_completed over the completed runs older than the timeout, which are only such lone
    runs (once) and the members of ready groups waiting for a step: its cost does not grow with the
    runs already ungrouped, trained or skipped. A sibling arriving later does not bring a run back: it
    waits for a sibling of its own.
    """
    cutoff = _ts(engine, (now or datetime.now(UTC)) - timedelta(seconds=group_timeout))
    where = (
        _status_is(engine, RunStatus.completed),
        Run.completed_at <= cutoff,
        Run.reward.is_not(None),
        Run.branch_of.is_(None),  # a sibling group's members are never ungrouped (ready once scored)
        _alone(),
    )
    async with engine.connect() as conn:
        if (await conn.execute(select(Run.id).where(*where).limit(1))).first() is None:
            return 0
    async with _write(engine) as conn:
        res = await conn.execute(
            update(Run)
            .where(*where)
            .values(status=RunStatus.ungrouped, status_reason=StatusReason.no_sibling)
            .execution_options(synchronize_session=False)
        )
    log.debug("ungrouped %d run(s): no sibling within %.1f s", res.rowcount, group_timeout)
    return int(res.rowcount or 0)


async def ungrouped_batch(
    engine: AsyncEngine, *, batch_size: int, wait: float, now: datetime | None = None
) -> ReadyGroup | None:
    """The next batch of `ungrouped` runs to train (singletons=train), or None while none is ready.

    The batch is the oldest `batch_size` ungrouped runs of the policy whose ungrouped run is oldest.
    It is ready when it holds `batch_size` runs, or at least 2 of which the newest was rewarded more
    than `wait` seconds ago (slow traffic: the rest of the batch is not coming soon). Two indexed
    reads of at most `batch_size` rows, however many runs are ungrouped.
    """
    ungrouped = (
        _status_is(engine, RunStatus.ungrouped),
        Run.policy.is_not(None),
        Run.reward.is_not(None),
        TRAIN_SPLIT,
    )
    order = (Run.completed_at, Run.id)
    async with engine.connect() as conn:
        first = (
            await conn.execute(
                select(Run.policy, SOURCE.label("source")).where(*ungrouped).order_by(*order).limit(1)
            )
        ).first()
        if first is None:
            return None
        policy = first.policy
        rows = (
            await conn.execute(
                select(Run.id, Run.reward, Run.completed_at)
                .where(*ungrouped, Run.policy == policy, SOURCE == first.source)  # one baseline, one source
                .order_by(*order)
                .limit(batch_size)
            )
        ).all()
    newest = max((_aware(r.completed_at) for r in rows if r.completed_at is not None), default=None)
    waited = newest is not None and newest <= (now or datetime.now(UTC)) - timedelta(seconds=wait)
    if len(rows) < batch_size and not (len(rows) >= 2 and waited):
        return None
    return ReadyGroup(
        policy,
        "(ungrouped)",
        [r.id for r in rows],
        [float(r.reward) for r in rows],
        newest or datetime.now(UTC),
        batch=True,
    )


def singleton_notice(by_status: dict[str, int]) -> str | None:
    """What to tell an operator when most rewarded runs are `ungrouped` (every task unique), else None.

    `by_status` is the run count per status (storage.queries.run_status_counts). Rewarded runs are the
    completed, trained, skipped and ungrouped ones; with `singletons=train` ungrouped runs are trained
    and the notice goes away by itself.
    """
    ungrouped = by_status.get(RunStatus.ungrouped, 0)
    rewarded = ungrouped + sum(
        by_status.get(s, 0) for s in (RunStatus.completed, RunStatus.trained, RunStatus.skipped)
    )
    if rewarded < NOTICE_MIN_RUNS or 2 * ungrouped <= rewarded:
        return None
    return (
        f"{ungrouped} of {rewarded} rewarded runs ({100 * ungrouped / rewarded:.0f}%) are ungrouped: "
        "no other run of their group arrived within group_timeout, so GRPO has nothing to compare "
        "them with and they are not trained. Every task looks unique (live traffic): set "
        "RLPROXY_SINGLETONS=train to train them against their batch's mean reward, and/or send "
        "X-Group-Id with a task family so similar tasks group together (README: Live traffic)."
    )


async def load_runs(engine: AsyncEngine, run_ids: list[str]) -> list[RunData]:
    """The runs `run_ids` with their completions, in the order given: only the completions created
    before the run's reward (a turn that slipped in after it, e.g. through another replica before
    it learnt the run was closed, is stored but never trained with that reward; issue 22)."""
    async with engine.connect() as conn:
        runs = {r.id: r for r in (await conn.execute(select(Run).where(Run.id.in_(run_ids)))).all()}
        comps = (
            await conn.execute(
                select(*(getattr(Completion, f.name) for f in fields(CompletionData)))
                .join(Run, Run.id == Completion.run_id)
                .where(Completion.run_id.in_(run_ids))
                .where(Run.completed_at.is_(None) | (Completion.created_at <= Run.completed_at))
                .order_by(Completion.run_id, Completion.seq)
            )
        ).all()
    out = {
        rid: RunData(
            rid,
            runs[rid].group_id,
            runs[rid].policy,
            float(runs[rid].reward or 0.0),  # unrewarded: a distilled run (sft --from-policy/--from-source)
            ungrouped=runs[rid].status == RunStatus.ungrouped,
            sibling=runs[rid].branch_of is not None,
        )
        for rid in run_ids
        if rid in runs
    }
    for c in comps:  # the columns of CompletionData's fields, by name
        out[c.run_id].completions.append(CompletionData(**{**c._mapping, "seq": c.seq or 0}))
    return [out[rid] for rid in run_ids if rid in out]


async def mark_runs(
    engine: AsyncEngine, run_ids: list[str], status: RunStatus, reason: StatusReason | None = None
) -> int:
    """Set still-trainable (`completed` or `ungrouped`) runs to `status` (skipped or failed), with
    `reason` in status_reason; returns how many changed."""
    if not run_ids:
        return 0
    async with _write(engine) as conn:
        res = await conn.execute(
            update(Run)
            .where(Run.id.in_(run_ids), Run.status.in_(TRAINABLE))
            .values(status=status, status_reason=reason)
        )
    return res.rowcount


async def skip_groups(engine: AsyncEngine, groups: list[ReadyGroup]) -> int:
    """Mark the runs of zero-variance groups `skipped` (no gradient, never trained); returns the run count."""
    run_ids = [rid for g in groups for rid in g.run_ids]
    return await mark_runs(engine, run_ids, RunStatus.skipped, StatusReason.zero_variance)


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
    columns: dict[str, Any] | None = None,
    run_segments: dict[str, tuple[int, str | None]] | None = None,
) -> None:
    """Record step `step` of `policy` and mark its runs `trained`, all or nothing.

    `run_segments` gives each run's `segments` and `segment_breaks` (migration 0010: how many rows
    its calls merged into, and why it split: a JSON list of {seq, reason, at, of}).

    `columns` fills the per-step metric columns (`kl`, `grad_norm`, ..., `kind`; migration 0005);
    `val_reward` / `val_runs` are the val runs served by step - 1, read in the same transaction.
    a name that is not a column of `training_steps` raises ValueError before anything is written.

    Raises StepConflict (and changes nothing) when a run is not `completed` any more (already
    trained by this step or another, skipped, ...) or when the step is already recorded.
    """
    run_ids = list(dict.fromkeys(run_ids))
    columns = dict(columns or {})
    unknown = set(columns) - set(STEP_METRIC_COLUMNS)
    if unknown:
        raise ValueError(f"not per-step metric columns of training_steps: {sorted(unknown)}")
    async with _write(engine) as conn:
        exists = await conn.scalar(
            select(func.count())
            .select_from(TrainingStep)
            .where(TrainingStep.policy == policy, TrainingStep.step == step)
        )
        if exists:
            raise StepConflict(f"step {step} of policy {policy!r} is already recorded")
        res = await conn.execute(  # an ungrouped run keeps its status_reason: trained as a singleton
            update(Run)
            .where(Run.id.in_(run_ids), Run.status.in_(TRAINABLE), TRAIN_SPLIT)
            .values(status=RunStatus.trained, trained_step=step)
        )
        if res.rowcount != len(run_ids):
            raise StepConflict(
                f"step {step} of policy {policy!r}: {len(run_ids) - res.rowcount} of {len(run_ids)} runs "
                "are no longer completed (trained or skipped elsewhere); nothing was committed"
            )
        for rid, (n, why) in (run_segments or {}).items():
            if rid in run_ids:
                await conn.execute(update(Run).where(Run.id == rid).values(segments=n, segment_breaks=why))
        # the adapter this step started from (step - 1), measured by the val runs it served so far
        val_reward, val_runs = await step_summary(conn, policy, step - 1)
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
                val_reward=val_reward,
                val_runs=val_runs,
                **columns,
            )
        )
    log.debug("committed step %d of %s (%d runs)", step, policy, len(run_ids))


async def latest_step(engine: AsyncEngine, policy: str) -> int:
    """The newest recorded step of `policy`; 0 when it has none (the base model)."""
    async with engine.connect() as conn:
        step = await conn.scalar(select(func.max(TrainingStep.step)).where(TrainingStep.policy == policy))
    return int(step or 0)


async def forget_adapter_paths(engine: AsyncEngine, policy: str, steps: list[int]) -> int:
    """Set `adapter_path` NULL on steps whose checkpoint folder was pruned (keep_checkpoints): a path in
    `training_steps` always names a folder that exists. Returns the rows changed."""
    if not steps:
        return 0
    async with _write(engine) as conn:
        res = await conn.execute(
            update(TrainingStep)
            .where(TrainingStep.policy == policy, TrainingStep.step.in_(steps))
            .values(adapter_path=None)
        )
    return res.rowcount


async def step_exists(engine: AsyncEngine, policy: str, step: int) -> bool:
    """True when `training_steps` holds step `step` of `policy`."""
    async with engine.connect() as conn:
        n = await conn.scalar(
            select(func.count())
            .select_from(TrainingStep)
            .where(TrainingStep.policy == policy, TrainingStep.step == step)
        )
    return bool(n)
