"""Where a policy comes from: starting one from a fork or a LoRA folder, in one transaction.

`start_policy` records the `policies` row (migration 0007) and the new policy's step 1 (`training_steps`,
`kind` fork or init, no runs) together, so a reader sees either no policy or a policy with its first
adapter. It refuses a policy that already has a step or a row (`PolicyExists`): a started policy is
never started again, and a fork never overwrites trained steps.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.errors import StorageError
from rlproxy.storage.db import write_transaction
from rlproxy.storage.models import PolicyOrigin, TrainingStep

log = logging.getLogger(__name__)


class PolicyExists(StorageError):
    """A policy to start (fork, init adapter) already has steps or a lineage row: it stays as it is."""

    status = 409
    code = "conflict"


async def start_policy(
    engine: AsyncEngine, *, policy: str, kind: str, adapter_path: str, parent: str | None = None,
    parent_step: int | None = None, init_adapter: str | None = None, config: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Record `policy` as started (`kind` fork or init) and its step 1 = the adapter at `adapter_path`."""
    now = datetime.now(UTC)
    async with write_transaction(engine) as conn:
        steps = await conn.scalar(
            select(func.count()).select_from(TrainingStep).where(TrainingStep.policy == policy)
        )
        row = await conn.scalar(
            select(func.count()).select_from(PolicyOrigin).where(PolicyOrigin.name == policy)
        )
        if steps or row:
            raise PolicyExists(
                f"policy {policy!r} already exists ({steps} step(s) recorded); pick a new name"
            )
        await conn.execute(
            insert(PolicyOrigin).values(
                name=policy,
                parent=parent,
                parent_step=parent_step,
                init_adapter=init_adapter,
                created_at=now,
            )
        )
        await conn.execute(
            insert(TrainingStep).values(
                step=1,
                policy=policy,
                adapter_path=adapter_path,
                started_at=now,
                finished_at=now,
                num_groups=0,
                num_runs=0,
                num_tokens=0,
                config=config,
                kind=kind,
            )
        )
    log.info("started policy %s (%s) at step 1: %s", policy, kind, adapter_path)


async def step_adapter(engine: AsyncEngine, policy: str, step: int) -> tuple[bool, str | None]:
    """(whether step `step` of `policy` is recorded, its adapter folder or None once pruned)."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                select(TrainingStep.adapter_path).where(
                    TrainingStep.policy == policy, TrainingStep.step == step
                )
            )
        ).first()
    return (row is not None, row.adapter_path if row is not None else None)
