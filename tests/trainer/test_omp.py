"""The trainer thread ends its OpenMP workers after each piece of torch work (rlproxy/trainer/omp.py).

Read on the OS side: /proc/self/task lists the process's threads, and a thread's first parallel
region with N torch threads starts N-1 OpenMP workers; ended, they are gone from that list.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy.ext.asyncio import AsyncEngine
from test_service import RecordingBackend, add_group

from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.omp import release_workers
from rlproxy.trainer.service import TrainerService

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2, reason="needs Linux and 2 cores"
)


def tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_work() -> float:
    x = torch.randn(1 << 21)
    return float(x.exp().sum() + (torch.randn(256, 256) @ torch.randn(256, 256)).sum())


def test_release_ends_the_calling_threads_workers_and_they_come_back():
    seen: dict[str, Any] = {}

    def worker() -> None:
        torch.set_num_threads(2)
        before = tasks()
        parallel_work()
        seen["with_pool"] = tasks() - before
        seen["released"] = release_workers()
        seen["after_release"] = tasks() - before
        seen["again"] = parallel_work()  # a new pool: work goes on
        seen["pool_again"] = tasks() - before
        release_workers()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["with_pool"] == 1, seen  # 2 torch threads: this thread and one OpenMP worker
    assert seen["released"] is True
    assert seen["after_release"] == 0, seen
    assert seen["pool_again"] == 1 and seen["again"] == seen["again"]  # finite


async def test_trainer_thread_holds_no_workers_between_steps(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = TrainerConfig(
        group_size=4,
        groups_per_step=1,
        learning_rate=1e-3,
        checkpoint_dir=str(tmp_path / "ck"),
        train_threads=2,
    )
    await add_group(engine, add_run, "A", [1.0, 0.0, 0.5, 0.25])
    svc = TrainerService(config, db_url, RecordingBackend(tiny_model_dir))
    try:
        assert (await svc.step_once())["step"] == 1
        assert svc._executor is not None
        idle = tasks()
        # torch work on the same thread without the release: it has to start a worker again
        svc._executor.submit(parallel_work).result()
        assert tasks() == idle + 1, "the trainer thread still had its OpenMP worker after the step"
        svc._executor.submit(release_workers).result()
        assert tasks() == idle
    finally:
        await svc.stop()
