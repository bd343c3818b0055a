"""Crash safety: SIGKILL a trainer process in the middle of a step, restart it, count the steps.

Runs are inserted directly, with token ids and logprobs sampled from the tiny model. The kill lands
(a) after the optimizer step, before anything is saved, and (b) after the checkpoint is saved,
while the adapter is being published, before the commit. Either way, after a restart: exactly one
step recorded, every run trained once by it, and the adapter on disk loads with peft.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlproxy.trainer import checkpoint as ckpt

PROC = Path(__file__).with_name("trainer_proc.py")


@pytest.fixture(scope="module")
def sampled(tiny_model_dir: Path) -> list[dict[str, Any]]:
    """8 completions sampled from the tiny model (2 prompts x 4), with their raw logprobs."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(0)
    out = []
    for prompt in ("Say a word.", "Name a city."):
        text_ = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text_, add_special_tokens=False, return_tensors="pt").input_ids
        for _ in range(4):
            with torch.no_grad():
                gen = model.generate(
                    ids, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=6, pad_token_id=tok.pad_token_id
                )
                new = gen[0, ids.shape[1] :]
                lp = (
                    model(gen).logits[0, ids.shape[1] - 1 : -1].log_softmax(-1).gather(-1, new[:, None])[:, 0]
                )
            out.append(
                {"prompt_token_ids": ids[0].tolist(), "token_ids": [new.tolist()], "logprobs": [lp.tolist()]}
            )
    return out


def run_proc(args: list[str], mode: str, marker: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(PROC), *args, mode, str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


@pytest.mark.parametrize("kill_at", ["hang-train", "hang-publish"])
async def test_sigkill_mid_step_then_restart(
    engine: AsyncEngine,
    add_run: Any,
    db_url: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    sampled: list,
    kill_at: str,
) -> None:
    for i, comp in enumerate(sampled):
        group = i // 4
        await add_run(engine, f"r{i}", group_id=f"g{group}", reward=float(i % 4 == group), completions=[comp])
    ck, marker = tmp_path / "ck", tmp_path / "marker"
    args = [db_url, str(ck), str(tiny_model_dir)]

    proc = run_proc(args, kill_at, marker)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the trainer never reached the kill point"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM training_steps"))).scalar() == 0
        assert (
            await conn.execute(text("SELECT count(*) FROM runs WHERE status = 'completed'"))
        ).scalar() == 8
    saved = ckpt.list_checkpoints(ck, "tiny")
    assert [c.step for c in saved] == ([1] if kill_at == "hang-publish" else [])

    restarted = run_proc(args, "normal", marker)
    out, err = restarted.communicate(timeout=300)
    assert restarted.returncode == 0, err.decode()[-3000:]
    # killed after saving: the restart commits the saved step (no training); else it trains it afresh
    assert json.loads(out.decode().strip().splitlines()[-1]) == {
        "steps": [] if kill_at == "hang-publish" else [1]
    }

    async with engine.connect() as conn:
        steps = (await conn.execute(text("SELECT step, num_runs, adapter_path FROM training_steps"))).all()
        runs = (
            await conn.execute(text("SELECT status, trained_step, count(*) FROM runs GROUP BY 1, 2"))
        ).all()
    assert [(s, n) for s, n, _ in steps] == [(1, 8)]
    assert [tuple(r) for r in runs] == [("trained", 1, 8)]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    PeftModel.from_pretrained(base, steps[0][2])  # the adapter on disk loads
    assert [c.step for c in ckpt.list_checkpoints(ck, "tiny")] == [1]
