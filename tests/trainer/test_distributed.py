"""`rlproxy train --nproc 2`: a real torchrun job (gloo, 2 CPU ranks) against the embedded engine.

1. One step on 2 ranks gives the LoRA of one single-process `train_step` on the same runs. Tolerance
   1e-6 absolute on weights of magnitude ~1e-2 (lr 1e-3): the ranks sum their share's fp32 gradients
   in another order and with other padding than one process does (~1e-7 relative), and AdamW's first
   step (g / (|g| + eps)) passes that through at most ~lr x 1e-4.
2. SIGKILL one rank mid-step (rank 1 before its gradient all-reduce; rank 0 after the checkpoint is
   saved, while publishing): the agent tears the other rank down and the job fails, naming the rank;
   nothing is committed. Started again, the job commits exactly one step, every run trained by it.

Fault points are set by a `sitecustomize.py` on the ranks' PYTHONPATH (the test writes it): it
patches one function in the rank named by RLPROXY_TEST_HANG, touches a marker and sleeps.
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
from safetensors.torch import load_file
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from test_crash import sampled  # noqa: F401  (fixture: 8 completions sampled from the tiny model)

from rlproxy.storage.training import load_runs
from rlproxy.trainer import checkpoint as ckpt
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import load_policy
from rlproxy.trainer.step import make_optimizer, train_step

LR, MICRO = 1e-3, 2  # micro-batches of 2: one process runs 4 of them, each rank 2 (other sums, same step)
TOLERANCE = 1e-6

HOOK = """
import os, time, pathlib
rank, hang = os.environ.get("RANK"), os.environ.get("RLPROXY_TEST_HANG", "")
out = pathlib.Path(os.environ.get("RLPROXY_TEST_OUT", "."))
if rank is not None:
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
if rank is not None and hang.startswith(f"{rank}:"):
    def stall(what):
        (out / "marker").write_text(f"{rank} {os.getpid()} {what}")
        time.sleep(3600)
    if hang == f"{rank}:reduce":  # mid-step: its share's backward done, before the gradient all-reduce
        from rlproxy.trainer import distributed
        real = distributed.Ranks.reduce
        def reduce(self, *a, **k):
            stall("reduce")
            return real(self, *a, **k)
        distributed.Ranks.reduce = reduce
    if hang == f"{rank}:publish":  # checkpoint saved, adapter being loaded, not committed
        from rlproxy.inference.vllm import VLLMBackend
        async def load_adapter(self, name, path):
            stall("publish")
        VLLMBackend.load_adapter = load_adapter
"""


def job(db_url: str, upstream: str, model: Path, tmp: Path, hang: str = "") -> subprocess.Popen:
    """`rlproxy train --nproc 2` as an operator would start it (the agent runs in this process)."""
    hooks = tmp / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(HOOK)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "RLPROXY_TEST_HANG": hang,
        "RLPROXY_TEST_OUT": str(tmp),
        "RLPROXY_CHECKPOINT_DIR": str(tmp / "ck"),
        "RLPROXY_LEARNING_RATE": str(LR),
        "RLPROXY_MICRO_BATCH_SIZE": str(MICRO),
        "RLPROXY_TRAIN_THREADS": "1",
        "RLPROXY_POLL_INTERVAL": "0.2",
        "OMP_NUM_THREADS": "1",
    }
    cli = Path(sys.executable).with_name("rlproxy")
    args = ["train", "--nproc", "2", "--db", db_url, "--upstream", upstream, "--model", str(model)]
    args += ["--group-size", "4", "--groups-per-step", "2"]
    return subprocess.Popen(
        [str(cli), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


async def steps(engine: AsyncEngine) -> list[tuple[int, int]]:
    async with engine.connect() as conn:
        return [tuple(r) for r in (await conn.execute(text("SELECT step, num_runs FROM training_steps")))]


async def train_one_step(engine: AsyncEngine, proc: subprocess.Popen, timeout: float = 300) -> str:
    """Wait for step 1's commit, then SIGTERM the job: it must stop cleanly (rank 0 stops rank 1)."""
    deadline = time.monotonic() + timeout
    while not await steps(engine):
        assert proc.poll() is None, proc.stdout.read().decode()[-4000:]
        assert time.monotonic() < deadline, "no step committed"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out[-4000:]
    return out


async def add_sampled(engine: AsyncEngine, add_run: Any, completions: list, policy: str) -> None:
    for i, comp in enumerate(completions):
        group = i // 4
        await add_run(
            engine, f"r{i}", group_id=f"g{group}", policy=policy, reward=float(i % 4 == group),
            completions=[comp],
        )  # fmt: skip


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


async def test_two_ranks_equal_one_process(
    engine: AsyncEngine,
    add_run: Any,
    db_url: str,
    tiny_model_dir: Path,
    embedded_backend: Any,
    tmp_path: Path,
    sampled: list,  # noqa: F811
) -> None:
    await add_sampled(engine, add_run, sampled, "dist-eq")
    proc = job(db_url, embedded_backend.base_url, tiny_model_dir, tmp_path)
    try:
        log = await train_one_step(engine, proc)
    finally:
        stop(proc)
    assert await steps(engine) == [(1, 8)]
    assert "rank 1" in log and "stopped by rank 0" in log  # both ranks ran; rank 1 left when told
    async with engine.connect() as conn:
        metrics = (await conn.execute(text("SELECT metrics FROM training_steps"))).scalar()
    assert json.loads(metrics)["perf/ranks"] == 2.0
    assert json.loads(metrics)["perf/micro_batches"] == 4.0  # 2 on each rank

    # the same step in this process: the same runs, config, seed (the LoRA's random A) and optimizer
    cfg = TrainerConfig(learning_rate=LR, micro_batch_size=MICRO, group_size=4, groups_per_step=2)
    torch.set_num_threads(1)
    model, tok = load_policy(str(tiny_model_dir), cfg)
    runs = await load_runs(engine, [f"r{i}" for i in range(8)])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    result = train_step(model, tok, make_optimizer(model, cfg), runs, cfg, 0)
    assert not result.skipped and result.metrics["perf/micro_batches"] == 4.0

    saved = load_file(str(ckpt.step_dir(tmp_path / "ck", "dist-eq", 1) / "adapter_model.safetensors"))
    ours = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    key = lambda n: n.replace(".default", "")  # noqa: E731  (peft saves without the adapter name)
    assert sorted(saved) == sorted(key(n) for n in ours)
    moved = max((ours[n] - before[n]).abs().max().item() for n in ours)
    diff = max((saved[key(n)] - ours[n]).abs().max().item() for n in ours)
    print(f"2 ranks vs 1 process: max |dw| {diff:.2e}, the step moved the LoRA by up to {moved:.2e}")
    assert moved > 100 * TOLERANCE, f"the step barely moved the LoRA ({moved:.2e}): nothing compared"
    assert diff <= TOLERANCE, f"2 ranks vs 1 process: max |dw| {diff:.2e} (the step moved {moved:.2e})"


@pytest.mark.parametrize("hang", ["1:reduce", "0:publish"])
async def test_sigkill_one_rank_then_restart(
    engine: AsyncEngine,
    add_run: Any,
    db_url: str,
    tiny_model_dir: Path,
    embedded_backend: Any,
    tmp_path: Path,
    sampled: list,  # noqa: F811
    hang: str,
) -> None:
    policy = f"dist-kill-{hang[0]}"
    await add_sampled(engine, add_run, sampled, policy)
    proc = job(db_url, embedded_backend.base_url, tiny_model_dir, tmp_path, hang)
    marker = tmp_path / "marker"
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-4000:]
            assert time.monotonic() < deadline, "the job never reached the kill point"
            time.sleep(0.1)
        rank, pid, _ = marker.read_text().split()
        os.kill(int(pid), signal.SIGKILL)
        out = proc.communicate(timeout=120)[0].decode()  # the agent tears the other rank down, then fails
    finally:
        stop(proc)
    assert proc.returncode != 0 and f"rank {rank} exit" in out and "SIGKILL" in out, out[-4000:]
    other = int((tmp_path / f"rank{1 - int(rank)}.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(other, 0)  # no rank outlives the job
    assert await steps(engine) == []
    saved = [c.step for c in ckpt.list_checkpoints(tmp_path / "ck", policy)]
    assert saved == ([1] if hang == "0:publish" else [])

    marker.unlink()
    proc = job(db_url, embedded_backend.base_url, tiny_model_dir, tmp_path)
    try:
        log = await train_one_step(engine, proc)
    finally:
        stop(proc)
    # killed after saving: the restart commits the saved step (recovery); else it trains it afresh
    assert ("recovered step 1" in log) == (hang == "0:publish"), log[-4000:]
    assert await steps(engine) == [(1, 8)]
    async with engine.connect() as conn:
        runs = (
            await conn.execute(text("SELECT status, trained_step, count(*) FROM runs GROUP BY 1, 2"))
        ).all()
    assert [tuple(r) for r in runs] == [("trained", 1, 8)]
    assert [c.step for c in ckpt.list_checkpoints(tmp_path / "ck", policy)] == [1]


def test_share_splits_whole_groups_then_samples() -> None:
    from rlproxy.storage.training import RunData
    from rlproxy.trainer.distributed import share
    from rlproxy.trainer.segments import Segment

    runs = [RunData(f"r{i}", f"g{i // 4}", "p", float(i), []) for i in range(8)]
    samples = [Segment(f"r{i}", 0.0, [1] * 4 + [2] * (i + 1)) for i in range(8)]
    two = [share(samples, runs, r, 2) for r in range(2)]
    assert {tuple(s.run_id for s in part) for part in two} == {
        ("r0", "r1", "r2", "r3"),
        ("r4", "r5", "r6", "r7"),
    }
    three = [share(samples, runs, r, 3) for r in range(3)]  # fewer groups than ranks: single samples
    ids = sorted(s.run_id for part in three for s in part)
    assert ids == [f"r{i}" for i in range(8)] and all(three)
    sizes = [sum(len(s) for s in part) for part in three]
    assert max(sizes) - min(sizes) <= 8  # balanced by tokens (LPT)
    assert share(samples[:1], runs, 1, 2) == []  # a rank may have nothing: it still joins the all-reduce
