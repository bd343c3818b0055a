"""The shadow check in SQL (issue 54): the prompts it samples, its `shadow_checks` rows, and the
`rollouts` row that says a step was stopped by it (trainer/shadow.py decides; docs/siblings.md).

Prompts: the newest stored calls of a policy that no step trained on: exact prompt ids, status ok,
not hosted, untagged ones included; a run's call only while the run is not `trained` and is an app's
run (`runs.branch_of` NULL: not a sibling the proxy sampled); one call per distinct prompt.

A step the check stops gets a `rollouts` row like a canary's rollback (status `rolled_back`,
`decided_by` 'shadow', a reason starting "shadow:"), written before the step commits, so every
reader that sees the step sees it rejected (proxy/rollout.py, `queries.latest_adapters`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, desc, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.db import write_transaction
from rlproxy.storage.models import Completion, Rollout, RolloutStatus, Run, ShadowCheck, TrainingStep, utcnow
from rlproxy.storage.times import iso

SCAN = 8  # rows read per prompt wanted: repeated prompts (a retried call, a group's shared task) are dropped
FINAL = ("passed", "failed", "skipped")  # a verdict that stands (a check in `error` may run again)


@dataclass(frozen=True)
class StoredPrompt:
    """One stored call the check asks both steps to answer again."""

    completion_id: int
    prompt_ids: list[int]
    request: dict[str, Any]  # the app's request body (max_tokens, temperature, stop, messages, tools...)
    endpoint: str | None


def _flat_ids(v: Any) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    return None


async def recent_prompts(
    engine: AsyncEngine, policy: str, limit: int, exclude_runs: Sequence[str] = ()
) -> list[StoredPrompt]:
    """Up to `limit` distinct stored prompts of `policy` not trained on, newest first; the calls of
    `exclude_runs` (the runs the candidate step was trained on, not yet marked) are left out."""
    q = (
        select(Completion.id, Completion.prompt_token_ids, Completion.request, Completion.endpoint)
        .select_from(Completion)
        .outerjoin(Run, Run.id == Completion.run_id)
        .where(
            Completion.policy == policy,
            Completion.prompt_token_ids.is_not(None),
            Completion.status == "ok",
            Completion.source.is_(None),
            or_(
                Completion.run_id.is_(None),
                and_(Run.status != "trained", Run.branch_of.is_(None)),
            ),
        )
        .order_by(desc(Completion.id))
        .limit(max(1, limit) * SCAN)
    )
    if exclude_runs:
        q = q.where(or_(Completion.run_id.is_(None), Completion.run_id.not_in(list(exclude_runs))))
    async with engine.connect() as conn:
        rows = (await conn.execute(q)).all()
    out: list[StoredPrompt] = []
    seen: set[tuple[int, ...]] = set()
    for cid, ids, request, endpoint in rows:
        flat = _flat_ids(ids)
        if flat is None or tuple(flat) in seen:
            continue
        seen.add(tuple(flat))
        out.append(StoredPrompt(int(cid), flat, request if isinstance(request, dict) else {}, endpoint))
        if len(out) >= limit:
            break
    return out


async def serving_step(engine: AsyncEngine, policy: str, before: int) -> int:
    """The step `policy` serves while `before` is checked: its newest step before it that was not
    rolled back (0: the base model)."""
    rejected = select(Rollout.candidate_step).where(
        Rollout.policy == policy, Rollout.status == RolloutStatus.rolled_back
    )
    q = select(func.max(TrainingStep.step)).where(
        TrainingStep.policy == policy, TrainingStep.step < before, TrainingStep.step.not_in(rejected)
    )
    async with engine.connect() as conn:
        return int(await conn.scalar(q) or 0)


async def get_check(engine: AsyncEngine, policy: str, step: int) -> dict[str, Any] | None:
    """The check of `policy@step`, or None."""
    q = select(ShadowCheck.__table__).where(ShadowCheck.policy == policy, ShadowCheck.candidate_step == step)
    async with engine.connect() as conn:
        r = (await conn.execute(q)).first()
    return {k: iso(v) for k, v in r._mapping.items()} if r is not None else None


async def start_check(
    engine: AsyncEngine, *, policy: str, step: int, serving: int, margin: float, scorer: str
) -> int:
    """The check of `policy@step` in status running (a new row, or an errored one tried again); its id."""
    values = {
        "serving_step": serving,
        "status": "running",
        "margin": margin,
        "scorer": scorer,
        "prompts": None,
        "candidate_score": None,
        "serving_score": None,
        "pairs": None,
        "reason": None,
        "created_at": utcnow(),
        "finished_at": None,
    }
    where = and_(ShadowCheck.policy == policy, ShadowCheck.candidate_step == step)
    async with write_transaction(engine) as conn:
        found = await conn.scalar(select(ShadowCheck.id).where(where))
        if found is not None:
            await conn.execute(update(ShadowCheck).where(ShadowCheck.id == found).values(**values))
            return int(found)
        try:
            res = await conn.execute(insert(ShadowCheck).values(policy=policy, candidate_step=step, **values))
        except IntegrityError:  # another trainer checks it (a leader handing over): share its row
            return int(await conn.scalar(select(ShadowCheck.id).where(where)))
        return int(res.inserted_primary_key[0])


async def finish_check(
    engine: AsyncEngine, check_id: int, *, status: str, reason: str, prompts: int | None = None,
    candidate_score: float | None = None, serving_score: float | None = None,
    pairs: list[dict[str, Any]] | None = None,
) -> None:  # fmt: skip
    """Write a check's outcome: passed, failed, skipped or error, its numbers and its reason."""
    async with write_transaction(engine) as conn:
        await conn.execute(
            update(ShadowCheck)
            .where(ShadowCheck.id == check_id)
            .values(
                status=status,
                reason=reason,
                prompts=prompts,
                candidate_score=candidate_score,
                serving_score=serving_score,
                pairs=pairs,
                finished_at=utcnow(),
            )
        )


async def reject_step(engine: AsyncEngine, *, policy: str, step: int, serving: int, reason: str) -> None:
    """Record `policy@step` as rolled back by the shadow check (before the step commits); idempotent."""
    where = and_(Rollout.policy == policy, Rollout.candidate_step == step)
    now = utcnow()
    async with write_transaction(engine) as conn:
        found = await conn.scalar(select(Rollout.id).where(where))
        if found is not None:  # a crash after this write: the row stands; a canary's row is closed
            await conn.execute(
                update(Rollout)
                .where(Rollout.id == found, Rollout.status == RolloutStatus.canary)
                .values(status=RolloutStatus.rolled_back, decision="rollback", decided_by="shadow",
                        reason=reason, decided_at=now)
            )  # fmt: skip
            return
        await conn.execute(
            insert(Rollout).values(
                policy=policy,
                candidate_step=step,
                incumbent_step=serving,
                fraction=0.0,  # it served nobody
                status=RolloutStatus.rolled_back,
                decision="rollback",
                decided_by="shadow",
                reason=reason,
                started_at=now,
                decided_at=now,
            )
        )


async def list_checks(
    engine: AsyncEngine, policy: str | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    """The newest shadow checks (of `policy`), newest first, as JSON-ready dicts."""
    q = select(ShadowCheck.__table__).order_by(desc(ShadowCheck.id)).limit(limit)
    if policy is not None:
        q = q.where(ShadowCheck.policy == policy)
    async with engine.connect() as conn:
        return [{k: iso(v) for k, v in r._mapping.items()} for r in (await conn.execute(q)).all()]
