"""Threads that run torch end their OpenMP workers when idle (rlproxy/omp.py): the trainer's after
each piece of torch work, the engine's before it waits for the next request.

Read on the OS side: /proc/self/task lists the process's threads, and a thread's first parallel
region with N torch threads starts N-1 OpenMP workers; ended, they are gone from that list.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy.ext.asyncio import AsyncEngine
from test_service import RecordingBackend, add_group

from rlproxy.omp import release_workers
from rlproxy.trainer.config import TrainerConfig
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
        seen["after_release"] = _settled() - before  # an ended worker leaves the list as it exits
        seen["again"] = parallel_work()  # a new pool: work goes on
        seen["pool_again"] = tasks() - before
        release_workers()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["with_pool"] == 1, seen  # 2 torch threads: this thread and one OpenMP worker
    assert seen["released"] is True
    assert seen["after_release"] == 0, seen
    assert seen["pool_again"] == 1 and math.isfinite(seen["again"])


async def test_trainer_thread_holds_no_workers_between_steps(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, config: TrainerConfig
) -> None:
    await add_group(engine, add_run, "A", [1.0, 0.0, 0.5, 0.25])
    two_threads = config.model_copy(update={"train_threads": 2})
    svc = TrainerService(two_threads, db_url, RecordingBackend(tiny_model_dir))
    try:
        assert (await svc.step_once())["step"] == 1
        assert svc._executor is not None
        idle = _settled()
        # torch work on the same thread without the release: it has to start a worker again
        svc._executor.submit(parallel_work).result()
        assert tasks() == idle + 1, "the trainer thread still had its OpenMP worker after the step"
        svc._executor.submit(release_workers).result()
        assert _settled() == idle
    finally:
        await svc.stop()


def test_engine_thread_holds_no_workers_while_idle(tiny_model_dir: Path) -> None:
    from rlproxy.inference.engine import Engine, GenRequest
    from rlproxy.inference.sampling import SamplingParams

    engine = Engine(str(tiny_model_dir), threads=2, max_batch=4)
    engine.start()
    try:
        finished = threading.Semaphore(0)
        params = SamplingParams(max_tokens=8, seed=0)
        sink = lambda d: d.finish_reason and finished.release()  # noqa: E731
        engine.submit(GenRequest("r", engine.tokenizer.encode("hello there"), params, sink, n=2))
        assert finished.acquire(timeout=60) and finished.acquire(timeout=60)
        idle = _settled()
        # work on the engine's thread: a worker starts only if the idle thread had none
        inside = engine.call(lambda: (parallel_work(), tasks())[1]).result(timeout=60)
        assert inside == idle + 1, "the idle engine thread still had its OpenMP worker"
        assert _settled() == idle  # idle again: ended again
    finally:
        engine.close()


def _settled(timeout: float = 10.0, quiet: float = 1.0) -> int:
    """The thread count once it has not changed for `quiet` seconds: an ended OpenMP worker leaves
    /proc/self/task only once its thread has exited, a moment after `omp_pause_resource_all`
    returns (CI read it at once and saw it still there), and the engine ends its workers as it goes
    idle."""
    deadline, last = time.monotonic() + timeout, tasks()
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = tasks()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    return last
