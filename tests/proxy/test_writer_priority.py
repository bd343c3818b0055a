"""`writer_idle_priority`: the writer process runs at the scheduler's idle priority (issue 24).

Why it exists (docs/performance.md, the fourth pass): on 2 cores, a request's next process woken
onto the core running the writer's batch waited behind it for the scheduler's wakeup granularity;
at SCHED_IDLE the writer yields at once. Through a real proxy under uvicorn on a stub upstream: the
setting reaches the writer process (and the one that replaces it after a kill -9), the default
leaves it at the normal policy, and the store is written the same either way.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")


def _serve(proxy, prefix: str) -> None:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for i in range(4):
            resp = client.post("/v1/chat/completions", json=body, headers={"X-Run-Id": f"{prefix}-{i % 2}"})
            assert resp.status_code == 200
        for run in (f"{prefix}-0", f"{prefix}-1"):
            assert client.post(f"/v1/runs/{run}/reward", json={"reward": 1.0}).status_code == 200


def _policy(proxy) -> int:
    return os.sched_getscheduler(proxy.state.writer._child.proc.pid)


def test_the_writer_process_runs_idle_when_asked_and_after_a_restart(make_proxy, stub) -> None:
    proxy = make_proxy(stub.url, writer_process=True, writer_idle_priority=True)
    _serve(proxy, "idle")
    assert _policy(proxy) == os.SCHED_IDLE
    first = proxy.state.writer._child.proc.pid
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the writer replaces a dead process (storage/writer.py)
        child = proxy.state.writer._child
        if child is not None and child.proc.pid != first and child.connected:
            break
        time.sleep(0.05)
    _serve(proxy, "again")
    assert proxy.state.writer._child.proc.pid != first
    assert _policy(proxy) == os.SCHED_IDLE
    assert proxy.query("SELECT count(*) FROM completions") == [(8,)]
    assert proxy.query("SELECT count(*) FROM runs WHERE reward = 1.0") == [(4,)]


def test_the_writer_process_runs_at_normal_priority_by_default(make_proxy, stub) -> None:
    proxy = make_proxy(stub.url, writer_process=True)
    _serve(proxy, "normal")
    assert _policy(proxy) == os.SCHED_OTHER
