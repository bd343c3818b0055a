"""training_steps' per-step metric columns (migration 0005) on SQLite and PostgreSQL: written by
commit_step in its one transaction, read back exactly; added to a database that already has steps."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.db import create_engine, downgrade, upgrade
from rlproxy.storage.training import STEP_METRIC_COLUMNS, commit_step

COLUMNS = {
    "reward_std": 0.5,
    "zero_variance_frac": 0.25,
    "kl": 3.5e-07,
    "clip_frac_low": 0.125,
    "clip_frac_high": 0.0,
    "entropy": 2.75,
    "completion_len_mean": 41.5,
    "policy_lag_mean": 1.5,
    "tokens_per_s": 1234.5,
    "grad_norm": 0.875,
    "positions_merged": 4006,  # migration 0010
    "positions_unmerged": 10478,
    "segment_breaks": 2,
    "kind": "grpo",
}


async def test_commit_step_writes_the_columns(engine: AsyncEngine) -> None:
    assert set(COLUMNS) == set(STEP_METRIC_COLUMNS)
    await commit_step(
        engine, policy="p", step=1, run_ids=[], adapter_path=None, mean_reward=0.5, loss=0.1,
        metrics={"kl/step": 3.5e-07}, columns=COLUMNS,
    )  # fmt: skip
    await commit_step(engine, policy="p", step=2, run_ids=[], adapter_path=None, columns={"kind": "sft"})
    names = ", ".join(STEP_METRIC_COLUMNS)
    async with engine.connect() as conn:
        rows = (await conn.execute(text(f"SELECT step, {names} FROM training_steps ORDER BY step"))).all()
    assert dict(zip(STEP_METRIC_COLUMNS, rows[0][1:], strict=True)) == COLUMNS
    assert rows[1][1:] == (None,) * 13 + ("sft",)


async def test_columns_added_to_existing_steps(any_db_url: str) -> None:
    """Upgrading a database that has steps: old rows get NULL metrics and kind 'grpo'; down and up again."""
    upgrade(any_db_url, "0004")
    engine = create_engine(any_db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO training_steps (step, policy, loss) VALUES (1, 'old', 0.5)"))
        upgrade(any_db_url)
        async with engine.connect() as conn:
            row = (await conn.execute(text("SELECT step, kind, kl, grad_norm FROM training_steps"))).one()
        assert tuple(row) == (1, "grpo", None, None)
        downgrade(any_db_url, "0004")
        async with engine.connect() as conn:
            cols = (await conn.execute(text("SELECT * FROM training_steps"))).keys()
        assert not set(STEP_METRIC_COLUMNS) & set(cols)
        upgrade(any_db_url)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("bad", [{"nope": 1.0}, {"metrics": {}}])
async def test_only_metric_columns(engine: AsyncEngine, bad: dict) -> None:
    with pytest.raises(ValueError, match="not per-step metric columns"):
        await commit_step(engine, policy="p", step=1, run_ids=[], adapter_path=None, columns=bad)
