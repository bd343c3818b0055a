"""Canary rollouts in SQL: the `rollouts` rows, their arms' runs, and every write a decision makes.

A rollout row is opened (`begin`) by the trainer after it loaded a new step's adapter and before it
commits the step: any process that sees the step in `training_steps` then sees its rollout too (one
read transaction: `snapshot`), so no replica ever serves a canary policy's new step to everyone.
Its incumbent is the policy's newest step before it that was not rolled back (0 = the base model).

One decision per candidate: a look (`record_look`) and a decision (`decide`) are conditional
UPDATEs (`WHERE status = 'canary'`, a look also `AND looks = k - 1`); whoever writes first wins and
the others change nothing, on SQLite (one writer at a time) and on PostgreSQL (the UPDATE locks the
row; the loser's re-checked WHERE no longer matches). UNIQUE (policy, candidate_step) keeps two
trainers from opening one candidate twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, delete, desc, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rlproxy.storage.db import write_transaction
from rlproxy.storage.models import Rollout, RolloutStatus, TrainingStep, utcnow
from rlproxy.storage.times import iso


@dataclass(frozen=True)
class ArmRun:
    """One run of an arm: its group, its reward (None: not rewarded yet), whether it errored."""

    group_id: str | None
    reward: float | None
    errored: bool = False
    key_id: str | None = None  # the app key that made it (None: the shared agents' key)


@dataclass
class Verdict:
    """The outcome of one look (or of no look: `look` 0 while collecting)."""

    decision: str  # continue | promote | rollback
    reason: str
    look: int = 0
    statistic: str | None = None  # welch_t | paired_t | errors_z
    value: float | None = None  # the statistic
    p_value: float | None = None  # one-sided, in the direction of the decision (p(up) otherwise)
    stats: dict[str, float] = field(default_factory=dict)  # per arm: runs, reward, error rate


@dataclass(frozen=True)
class OpenRollout:
    """A canary in progress, as the router needs it."""

    id: int
    candidate: int
    incumbent: int
    fraction: float


@dataclass(frozen=True)
class PolicyRollouts:
    """What a replica must know of one policy to route it (one consistent read)."""

    max_step: int  # newest step in training_steps
    open: OpenRollout | None = None
    rejected: frozenset[int] = field(default_factory=frozenset)  # rolled-back steps, never served
    stable: int = 0  # the step every run gets outside a canary: newest not rejected, not on trial
    previous: int | None = None  # incumbent of the rollout that promoted `stable`: its runs finish on it


def _row(r: Any) -> dict[str, Any]:
    return {k: iso(v) for k, v in r._mapping.items()}


async def _incumbent(conn: AsyncConnection, policy: str, step: int) -> int:
    """The newest step of `policy` before `step` that is not rolled back (0: the base model)."""
    rejected = select(Rollout.candidate_step).where(
        Rollout.policy == policy, Rollout.status == RolloutStatus.rolled_back
    )
    q = select(func.max(TrainingStep.step)).where(
        TrainingStep.policy == policy, TrainingStep.step < step, TrainingStep.step.not_in(rejected)
    )
    return int(await conn.scalar(q) or 0)


async def begin(engine: AsyncEngine, policy: str, step: int, fraction: float) -> tuple[int, bool]:
    """Open the rollout of `policy@step` (before the step commits); (its id, whether this call
    inserted it: False when a crashed predecessor already had)."""
    async with write_transaction(engine) as conn:
        found = await conn.scalar(
            select(Rollout.id).where(Rollout.policy == policy, Rollout.candidate_step == step)
        )
        if found is not None:
            return int(found), False
        incumbent = await _incumbent(conn, policy, step)
        try:
            res = await conn.execute(
                insert(Rollout).values(
                    policy=policy,
                    candidate_step=step,
                    incumbent_step=incumbent,
                    fraction=fraction,
                    status=RolloutStatus.canary,
                    decision="continue",
                    reason="collecting",
                    started_at=utcnow(),
                )
            )
        except IntegrityError:  # another trainer opened it between our read and our insert
            return int(
                await conn.scalar(
                    select(Rollout.id).where(Rollout.policy == policy, Rollout.candidate_step == step)
                )
            ), False
        return int(res.inserted_primary_key[0]), True


async def abort(engine: AsyncEngine, rollout_id: int) -> None:
    """Remove a rollout whose step never committed (its step belongs to nobody)."""
    async with write_transaction(engine) as conn:
        await conn.execute(delete(Rollout).where(Rollout.id == rollout_id, Rollout.status == "canary"))


async def snapshot(engine: AsyncEngine) -> dict[str, PolicyRollouts]:
    """Per policy with steps: its newest step, open rollout, rolled-back steps and stable step, read in
    one transaction (a step seen here has its rollout row seen here too)."""
    async with engine.connect() as conn, conn.begin():
        steps: dict[str, list[int]] = {}
        for p, s in (await conn.execute(select(TrainingStep.policy, TrainingStep.step))).all():
            steps.setdefault(p, []).append(int(s))
        rows = (
            await conn.execute(
                select(
                    Rollout.id,
                    Rollout.policy,
                    Rollout.candidate_step,
                    Rollout.incumbent_step,
                    Rollout.fraction,
                    Rollout.status,
                ).order_by(Rollout.candidate_step)
            )
        ).all()
    out: dict[str, PolicyRollouts] = {}
    for policy, ss in steps.items():
        mine = [r for r in rows if r.policy == policy]
        rejected = frozenset(int(r.candidate_step) for r in mine if r.status == RolloutStatus.rolled_back)
        opened = [r for r in mine if r.status == RolloutStatus.canary]
        o = opened[-1] if opened else None
        trial = {int(r.candidate_step) for r in opened}
        good = [s for s in ss if s not in rejected and s not in trial]
        stable = max(good) if good else 0
        won = [r for r in mine if r.status == RolloutStatus.promoted and int(r.candidate_step) == stable]
        out[policy] = PolicyRollouts(
            max_step=max(ss),
            open=OpenRollout(int(o.id), int(o.candidate_step), int(o.incumbent_step), float(o.fraction))
            if o is not None
            else None,
            rejected=rejected,
            stable=stable,
            previous=int(won[-1].incumbent_step) if won else None,
        )
    return out


async def list_rollouts(
    engine: AsyncEngine, policy: str | None = None, limit: int = 20, status: str | None = None
) -> list[dict[str, Any]]:
    """The newest rollouts (of `policy`, in `status`), newest first, as JSON-ready dicts."""
    q = select(Rollout.__table__).order_by(desc(Rollout.started_at), desc(Rollout.id)).limit(limit)
    if policy is not None:
        q = q.where(Rollout.policy == policy)
    if status is not None:
        q = q.where(Rollout.status == status)
    async with engine.connect() as conn:
        return [_row(r) for r in (await conn.execute(q)).all()]


async def get_rollout(engine: AsyncEngine, rollout_id: int) -> dict[str, Any] | None:
    """One rollout row by id."""
    async with engine.connect() as conn:
        r = (await conn.execute(select(Rollout.__table__).where(Rollout.id == rollout_id))).first()
    return _row(r) if r is not None else None


async def arm_runs(engine: AsyncEngine, rollout_id: int) -> tuple[list[ArmRun], list[ArmRun]]:
    """(candidate, incumbent) runs of a rollout from the `rollout_runs` view (rewarded or not)."""
    q = text(
        "SELECT arm, group_id, reward, errored, key_id FROM rollout_runs WHERE rollout_id = :id "
        "ORDER BY created_at, run_id"
    )
    cand: list[ArmRun] = []
    inc: list[ArmRun] = []
    async with engine.connect() as conn:
        for arm, group, reward, errored, key_id in (await conn.execute(q, {"id": rollout_id})).all():
            r = None if reward is None else float(reward)
            (cand if arm == "candidate" else inc).append(ArmRun(group, r, bool(errored), key_id))
    return cand, inc


async def arm_series(engine: AsyncEngine, rollout_id: int) -> list[dict[str, Any]]:
    """Rewarded runs of both arms in reward order: {arm, completed_at, reward} (the dashboard's chart)."""
    q = text(
        "SELECT arm, completed_at, reward FROM rollout_runs WHERE rollout_id = :id "
        "AND reward IS NOT NULL ORDER BY completed_at"
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(q, {"id": rollout_id})).all()
    return [{"arm": a, "completed_at": iso(t), "reward": float(r)} for a, t, r in rows]


def _finite(x: float | None) -> float | None:
    """None for a missing, NaN or infinite number (an arm without runs, a statistic without variance)."""
    return x if x is not None and math.isfinite(x) else None


def _stats(v: Verdict) -> dict[str, Any]:
    s = v.stats
    return {
        "candidate_runs": int(s.get("candidate_runs", 0)),
        "incumbent_runs": int(s.get("incumbent_runs", 0)),
        "candidate_reward": _finite(s.get("candidate_reward")),
        "incumbent_reward": _finite(s.get("incumbent_reward")),
        "candidate_error_rate": _finite(s.get("candidate_error_rate")),
        "incumbent_error_rate": _finite(s.get("incumbent_error_rate")),
    }


async def record_look(engine: AsyncEngine, rollout_id: int, verdict: Verdict, looks_done: int) -> bool:
    """Store a verdict: its numbers always; a look (`verdict.look` > `looks_done`) only once, by
    whoever writes it first; a promote / rollback closes the rollout. True when this call wrote the
    look or the decision (False: another process did, or it is closed already)."""
    values: dict[str, Any] = {**_stats(verdict), "looked_at": utcnow(), "reason": verdict.reason}
    cond = and_(Rollout.id == rollout_id, Rollout.status == RolloutStatus.canary)
    if verdict.look > looks_done:
        values.update(
            looks=verdict.look,
            decision=verdict.decision,
            statistic=verdict.statistic,
            stat_value=_finite(verdict.value),
            p_value=verdict.p_value,
        )
        cond = and_(cond, Rollout.looks == looks_done)
        if verdict.decision in ("promote", "rollback"):
            values.update(
                status=RolloutStatus.promoted if verdict.decision == "promote" else RolloutStatus.rolled_back,
                decided_by="rule",
                decided_at=utcnow(),
            )
    async with write_transaction(engine) as conn:
        res = await conn.execute(update(Rollout).where(cond).values(**values))
    return res.rowcount == 1 and verdict.look > looks_done


async def decide(
    engine: AsyncEngine, rollout_id: int, decision: str, reason: str, by: str = "manual"
) -> bool:
    """Promote or roll back an open rollout by hand; False when it is not open any more."""
    if decision not in ("promote", "rollback"):
        raise ValueError(f"decision must be promote or rollback, not {decision!r}")
    status = RolloutStatus.promoted if decision == "promote" else RolloutStatus.rolled_back
    async with write_transaction(engine) as conn:
        res = await conn.execute(
            update(Rollout)
            .where(Rollout.id == rollout_id, Rollout.status == RolloutStatus.canary)
            .values(status=status, decision=decision, decided_by=by, reason=reason, decided_at=utcnow())
        )
    return res.rowcount == 1


async def rolled_back_adapters(engine: AsyncEngine) -> list[tuple[str, int, str]]:
    """(policy, step, adapter_path) of rolled-back steps whose checkpoint is still recorded: what the
    trainer deletes (it never trains from or serves them again)."""
    q = (
        select(TrainingStep.policy, TrainingStep.step, TrainingStep.adapter_path)
        .join(
            Rollout,
            and_(Rollout.policy == TrainingStep.policy, Rollout.candidate_step == TrainingStep.step),
        )
        .where(Rollout.status == RolloutStatus.rolled_back, TrainingStep.adapter_path.is_not(None))
    )
    async with engine.connect() as conn:
        return [(p, int(s), path) for p, s, path in (await conn.execute(q)).all()]


async def open_rollouts(engine: AsyncEngine) -> list[dict[str, Any]]:
    """Every rollout in status canary."""
    return await list_rollouts(engine, limit=1000, status=RolloutStatus.canary)


async def step_paths(engine: AsyncEngine, policy: str, steps: list[int]) -> dict[int, str]:
    """step -> adapter_path of the given steps of `policy` that still have one."""
    q = select(TrainingStep.step, TrainingStep.adapter_path).where(
        TrainingStep.policy == policy, TrainingStep.step.in_(steps), TrainingStep.adapter_path.is_not(None)
    )
    async with engine.connect() as conn:
        return {int(s): p for s, p in (await conn.execute(q)).all()}


# ------------------------------------------- modes (the `rollout` setting: settings.parse_rollout)


def mode_of(modes: dict[str, str], policy: str) -> str:
    """The rollout mode of `policy` (its own entry, else `*`, else immediate)."""
    return modes.get(policy, modes.get("*", "immediate"))
