"""GRPO step time of `rlproxy train --nproc 2` against one rank, on the same batch, same run.

    .venv/bin/python bench/distributed.py [--quick] [--model smollm2-135m] [--steps 3]

Method. Each setting is a real torch.distributed job started with `torch.distributed.run` (gloo on
CPU, NCCL on CUDA) whose ranks run the trainer's own distributed step (trainer/distributed.py:
rank 0's `Leader.train_step`, the others `follow`): rank 0 sends the runs and its LoRA weights, each
rank trains its share of the groups, the LoRA gradients are all-reduced, rank 0 clips and steps.
The batch is bench/trainer.py's: 8 sequences of 64 prompt + 64 completion tokens in 2 groups of 4,
LoRA r=16 on every projection, loss grpo, one micro-batch per rank. Rank 0 times `--steps` steps
after one warm-up; the figure is the median. Settings: 1 rank x 1 thread (the baseline), 1 rank x
2 threads (the same cores as 2 ranks), 2 ranks x 1 thread. `--quick` uses the tiny model.

On a CPU box the point is correctness, not speed: 2 ranks split 8 sequences into 2 x 4, and each
rank pays its own Python, batching and all-reduce overhead. On GPUs (one per rank, NCCL) the step is
compute-bound and the LoRA all-reduce is a few MB, so N ranks should give close to N x the
sequences per second at a fixed per-GPU batch (the 'weak scaling' a larger `groups_per_step` uses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(model_dir: str, steps: int) -> None:
    """One rank of a timed job (started by torchrun)."""
    import torch
    from gpu_check import make_runs, token_data

    from rlproxy.trainer import distributed
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy
    from rlproxy.trainer.step import make_optimizer

    torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    cfg = TrainerConfig(learning_rate=1e-5, micro_batch_size=8, checkpoint_dir=os.environ["BENCH_CKPT"])
    ranks = distributed.init()
    try:
        if not ranks.leader:
            return distributed.follow(ranks, cfg)
        leader = distributed.Leader(ranks)
        leader.model_path = model_dir
        model, tok = load_policy(model_dir, cfg)
        opt = make_optimizer(model, cfg)
        runs = make_runs(*token_data(len(tok)), None)
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            r = leader.train_step(model, tok, opt, runs, cfg)
            if i:
                times.append(time.perf_counter() - t0)
            assert not r.skipped
        leader.stop()
        print("RESULT " + json.dumps({"times": times, "ranks": ranks.world}), flush=True)
    finally:
        distributed.shutdown()


def job(model_dir: str, nproc: int, threads: int, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as ckpt:
        env = {
            **os.environ,
            "BENCH_THREADS": str(threads),
            "BENCH_CKPT": ckpt,
            "OMP_NUM_THREADS": str(threads),
        }
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd = [
            *launch,
            str(HERE / "distributed.py"),
            "--worker",
            "--model-dir",
            model_dir,
            "--steps",
            str(steps),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"job --nproc {nproc} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))["times"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 timed steps")
    ap.add_argument("--model", default="smollm2-135m", help="model name or folder")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per setting (after one warm-up)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.model_dir, a.steps)

    from rlproxy.inference.models import resolve_model

    model = "tiny" if a.quick else a.model
    steps = a.steps or (2 if a.quick else 3)
    model_dir = resolve_model(model)
    print(f"GRPO step, 8 x 128 tokens, {model}, median of {steps} steps after a warm-up (rank 0's clock)")
    base = None
    for nproc, threads in ((1, 1), (1, 2), (2, 1)):
        med = statistics.median(job(model_dir, nproc, threads, steps))
        base = base or med
        print(
            f"  --nproc {nproc} x {threads} thread(s): {med * 1000:7.0f} ms/step   {base / med:.2f}x baseline"
        )


if __name__ == "__main__":
    main()
