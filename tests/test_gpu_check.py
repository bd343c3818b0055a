"""`make gpu-check` (bench/gpu_check.py) in its CPU mode, so the script a GPU box runs cannot rot.

On this CPU-only machine it runs every part on CPU: the trainer checks in fp32 (`--cpu`, one timed
step), the embedded engine with the adapter the trainer saved, and `rlproxy train --nproc 1` through
torch.distributed.run on gloo until its step is committed. The CUDA-only statements (bf16 body, peak
memory, NCCL) are what it cannot check here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_mode(tiny_model_dir: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--cpu",
            "--steps",
            "1",
            "--model",
            str(tiny_model_dir),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-4000:]
    assert "gpu-check: all checks passed" in out
    if not torch.cuda.is_available():
        assert "no CUDA: the CUDA parts did not run" in out
    for part in ("trainer: ", "embedded engine", "distributed launcher: rlproxy train --nproc 1"):
        assert part in out, out
    assert out.count("  ok   ") >= 20 and "FAIL" not in out  # every check ran and passed
    assert "step 1 committed, 8 runs" in out and "on 1 rank(s)" in out
