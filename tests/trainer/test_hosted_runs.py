"""Runs a hosted (text-only) upstream answered are never GRPO samples, and the trainer says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import text
from support import ServerlessBackend

from rlproxy.storage.training import CompletionData
from rlproxy.trainer.batches import usable
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.service import TrainerService

REPLY = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Alice: 4821"}}]}
HOSTED = {
    "source": "hosted",
    "request": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
    "response": REPLY,
    "prompt_token_ids": None,
    "token_ids": None,
    "logprobs": None,
}


def test_a_hosted_reply_is_not_usable() -> None:
    """Before: a reply without token ids was usable, and rebuilt from its text with the template."""
    comp = CompletionData("r", 0, 0, "chat.completions", HOSTED["request"], REPLY, None, None, None, "ok")
    assert usable(comp)
    comp.source = "hosted"
    assert not usable(comp)


async def test_hosted_runs_skipped_and_counted(
    engine: Any, db_url: str, add_run: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    for i, reward in enumerate([1.0, 0.0]):
        await add_run(
            engine, f"t{i}", group_id="teach", policy="teacher", reward=reward, completions=[HOSTED]
        )
    config = TrainerConfig(group_size=2, checkpoint_dir=str(tmp_path / "ck"), poll_interval=0.1)
    svc = TrainerService(config, db_url, ServerlessBackend(tiny_model_dir))
    try:
        assert await svc.step_once() is None  # nothing to train: no fake step, no rebuilt samples
        assert svc.selection.hosted_skipped == 2 and svc.steps_done == 0
        # the next real step says how many hosted runs were left out since the last one
        for i, reward in enumerate([1.0, 0.0]):
            await add_run(engine, f"s{i}", group_id="stu", policy="tiny", reward=reward)
        metrics = await svc.step_once()
        assert metrics is not None and metrics["data/hosted_runs_skipped"] == 2.0
    finally:
        await svc.stop()
    async with engine.connect() as conn:
        rows = (
            await conn.execute(text("SELECT status, status_reason FROM runs WHERE policy = 'teacher'"))
        ).all()
    assert rows == [("skipped", "hosted"), ("skipped", "hosted")]
