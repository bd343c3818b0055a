"""Validation runs: what each adapter step scored on runs that are measured, never trained.

A run is a validation run when its first request carried `X-Split: val` or its reward body said
`"split": "val"` (`runs.split`). Rewarded, it becomes `validated`, never `completed`: every trainer
query starts from `completed` or `ungrouped`, so a val run is never grouped, batched or trained.

A val run is *served by step S* when every completion of it has `policy_step` S (0 = the base
model; a pinned `policy@S` request counts the same). Runs spanning a hot-swap count for no step.

- `step_summary(conn, policy, step)`: mean reward and count of the val runs served by `step`;
  `commit_step` stores it for `step - 1` in `training_steps.val_reward` / `val_runs` of the new row
  (frozen at the commit: the adapter the step started from, the one its `mean_reward` sampled).
- `step_scores(engine, policy)`: the same for every step, live (late rewards included): the SQL view
  `validation(policy, step, val_runs, val_reward)` computes it too.
- `best_step(...)`: the adapter step with the highest val reward, which checkpoint retention keeps
  besides the newest `keep_checkpoints` (ties: the newest such step).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rlproxy.storage.models import Completion, Run, RunStatus

SPLITS: tuple[str, ...] = ("train", "val")  # runs.split values; `train` is the default


def _served(policy: str) -> Select[Any]:
    """(step, reward) of every rewarded val run of `policy` served by one step."""
    first = select(func.min(Completion.policy_step)).where(Completion.run_id == Run.id).scalar_subquery()
    last = select(func.max(Completion.policy_step)).where(Completion.run_id == Run.id).scalar_subquery()
    runs = (
        select(Run.reward.label("reward"), first.label("step"), last.label("last"))
        .where(Run.status == RunStatus.validated, Run.reward.is_not(None), Run.policy == policy)
        .subquery()
    )
    return select(runs.c.step, runs.c.reward).where(runs.c.step.is_not(None), runs.c.step == runs.c.last)


def _scores(policy: str, step: int | None = None) -> Select[Any]:
    served = _served(policy).subquery()
    q = select(served.c.step, func.count().label("n"), func.avg(served.c.reward).label("mean"))
    if step is not None:
        q = q.where(served.c.step == step)
    return q.group_by(served.c.step)


async def step_summary(conn: AsyncConnection, policy: str, step: int) -> tuple[float | None, int]:
    """(mean reward, count) of the rewarded val runs of `policy` served by `step`; (None, 0) if none."""
    row = (await conn.execute(_scores(policy, step))).first()
    return (float(row.mean), int(row.n)) if row is not None else (None, 0)


async def step_scores(engine: AsyncEngine, policy: str) -> dict[int, tuple[float, int]]:
    """step -> (mean val reward, val runs) for every adapter step of `policy` that served val runs."""
    async with engine.connect() as conn:
        rows = (await conn.execute(_scores(policy))).all()
    return {int(r.step): (float(r.mean), int(r.n)) for r in rows}


def pick_best(scores: dict[int, tuple[float, int]], *, min_runs: int = 1) -> int | None:
    """The step with the highest mean val reward among those with at least `min_runs` val runs and
    step >= 1 (the base model has no checkpoint); ties go to the newest step. None when none qualifies."""
    ranked = [(mean, step) for step, (mean, n) in scores.items() if step >= 1 and n >= min_runs]
    return max(ranked)[1] if ranked else None


async def best_step(engine: AsyncEngine, policy: str, *, min_runs: int = 1) -> int | None:
    """The adapter step of `policy` with the best validation reward so far (see `pick_best`)."""
    return pick_best(await step_scores(engine, policy), min_runs=min_runs)
