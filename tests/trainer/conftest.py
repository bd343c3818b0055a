"""Trainer fixtures: a migrated SQLite database per test and a helper that inserts rewarded runs directly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.db import create_engine, upgrade
from rlproxy.storage.models import Completion, Run
from rlproxy.trainer.config import TrainerConfig

torch.set_num_threads(1)  # the machine is shared: one thread per test process


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    """The test's fresh database, migrated to head."""
    upgrade(db_url)
    eng = create_engine(db_url)
    yield eng
    await eng.dispose()


async def _add_run(
    engine: AsyncEngine,
    run_id: str,
    *,
    group_id: str = "g1",
    policy: str = "tiny",
    reward: float | None = 1.0,
    status: str = "completed",
    completed_ago: float = 0.0,
    completions: list[dict[str, Any]] | None = None,
) -> None:
    """Insert a run (and its completions, dicts of Completion columns) as the writer would have."""
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        await conn.execute(
            insert(Run).values(
                id=run_id,
                group_id=group_id,
                policy=policy,
                status=status,
                reward=reward,
                created_at=now - timedelta(seconds=completed_ago + 1),
                completed_at=now - timedelta(seconds=completed_ago) if reward is not None else None,
            )
        )
        for seq, c in enumerate(
            completions
            if completions is not None
            else [{"prompt_token_ids": [1, 2, 3], "token_ids": [[4, 5]], "logprobs": [[-0.5, -0.25]]}]
        ):
            await conn.execute(
                insert(Completion).values(
                    **{
                        "run_id": run_id,
                        "seq": seq,
                        "policy": policy,
                        "policy_step": 0,
                        "status": "ok",
                        # made before the reward, as served (only those are trained: issue 22)
                        "created_at": now - timedelta(seconds=completed_ago + 1),
                        **c,
                    }
                )
            )


@pytest.fixture
def add_run() -> Any:
    """`await add_run(engine, run_id, group_id=..., reward=..., completions=[...])` inserts a run."""
    return _add_run


@pytest.fixture
def config(tmp_path: Path) -> TrainerConfig:
    """A service's settings: steps of one group of 4, polled fast (test_step.py has its own)."""
    return TrainerConfig(
        group_size=4,
        groups_per_step=1,
        learning_rate=1e-3,
        checkpoint_dir=str(tmp_path / "ck"),
        poll_interval=0.05,
    )
