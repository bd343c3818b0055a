"""TrainerService with canary rollouts (trainer/rollout.py) on a real SQLite file and the tiny model:
training holds while a step is on trial, a rolled-back step is deleted and unloaded and the next step
starts from the incumbent, and the incumbent survives keep_checkpoints=1 while it serves."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from test_service import RecordingBackend, add_group

from rlproxy.settings import RolloutSettings
from rlproxy.storage import rollouts as store
from rlproxy.trainer import checkpoint as ckpt
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.rollout import RolloutController
from rlproxy.trainer.service import TrainerService


async def test_hold_rollback_retrain_from_incumbent_protect(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = TrainerConfig(
        group_size=4,
        groups_per_step=1,
        learning_rate=1e-3,
        checkpoint_dir=str(tmp_path / "ck"),
        poll_interval=0.05,
        keep_checkpoints=1,
        unload_grace=0.2,
    )
    backend = RecordingBackend(tiny_model_dir)
    controller = RolloutController(
        RolloutSettings(rollout="canary", canary_min_runs=1000)
    )  # the rule never looks here
    svc = TrainerService(config, db_url, backend, rollouts=controller)
    try:
        await add_group(engine, add_run, "A", [1.0, 0.0, 0.5, 0.25], seed=1)
        assert (await svc.step_once())["step"] == 1
        await add_group(engine, add_run, "B", [1.0, 0.0, 0.5, 0.25], seed=2)
        assert await svc.step_once() is None  # step 1 is on trial: B waits
        (r1,) = await store.open_rollouts(engine)
        assert (r1["candidate_step"], r1["incumbent_step"]) == (1, 0)

        assert await store.decide(engine, r1["id"], "rollback", "test")
        m = await svc.step_once()  # cleans step 1 up, then trains B from the incumbent (the base)
        assert m["step"] == 2
        assert not ckpt.step_dir(config.checkpoint_dir, "tiny", 1).exists()
        async with engine.connect() as conn:
            paths = dict((await conn.execute(text("SELECT step, adapter_path FROM training_steps"))).all())
        assert paths[1] is None and paths[2]
        await asyncio.sleep(0.5)
        assert "tiny@1" not in backend.loaded  # unloaded after unload_grace
        (r2,) = await store.open_rollouts(engine)
        assert (r2["candidate_step"], r2["incumbent_step"]) == (2, 0)

        assert await store.decide(engine, r2["id"], "promote", "test")
        await add_group(engine, add_run, "C", [1.0, 0.0, 0.5, 0.25], seed=3)
        assert (await svc.step_once())["step"] == 3
        (r3,) = await store.open_rollouts(engine)
        assert (r3["candidate_step"], r3["incumbent_step"]) == (3, 2)
        await asyncio.sleep(0.5)
        # keep_checkpoints=1 would have pruned and unloaded step 2: it serves the incumbent arm
        assert {c.step for c in ckpt.list_checkpoints(config.checkpoint_dir, "tiny")} == {2, 3}
        assert {"tiny@2", "tiny@3"} <= set(backend.loaded)
    finally:
        await svc.stop()
