"""`rlproxy_event_loop_lag_seconds` (proxy/metrics.py `watch_loop`) on the loop `serve` runs: uvloop.

A stall is recorded at its length, and an idle loop's samples have sub-millisecond resolution:
read from `loop.time()` they were libuv's cached millisecond, so every sample was a whole number of
milliseconds (an idle proxy's 1.0 ms samples filled the 2 ms bucket). The sampler slows down while no
request comes (100 wake-ups a second were an idle proxy's whole CPU) and is back at its pace within
one slow interval of a request, in a served proxy too (`Limits.busy` sets its pace).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import httpx
import uvloop

from rlproxy.proxy.metrics import _LAG_BUCKETS, Metrics

_BOUNDS = list(_LAG_BUCKETS)  # the histogram's own bucket bounds


def _sample(stall_s: float) -> tuple[list[float], float]:
    """(the samples' cumulative bucket counts, their sum) after ~30 idle ticks and one stall."""
    metrics = Metrics()

    async def main() -> None:
        task = asyncio.create_task(metrics.watch_loop(interval=0.005))
        await asyncio.sleep(0.15)
        if stall_s:
            time.sleep(stall_s)  # blocking work on the loop, on purpose
            await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    uvloop.run(main())
    hist = {
        s.labels["le"]: s.value
        for m in metrics.loop_lag.collect()
        for s in m.samples
        if s.name.endswith("_bucket")
    }
    total = next(s.value for m in metrics.loop_lag.collect() for s in m.samples if s.name.endswith("_sum"))
    assert sorted(float(k) for k in hist)[:-1] == _BOUNDS
    return [hist[k] for k in sorted(hist, key=float)], total


def test_a_stall_is_recorded_at_its_length() -> None:
    counts, total = _sample(0.04)
    at_25ms = counts[_BOUNDS.index(0.025)]
    assert counts[-1] - at_25ms == 1  # exactly one sample above 25 ms: the stall
    assert total >= 0.035


def test_idle_samples_are_not_whole_milliseconds() -> None:
    counts, total = _sample(0.0)
    assert counts[-1] >= 10
    ms = total * 1000
    assert abs(ms - round(ms)) > 1e-6, f"sum {ms!r} ms: every sample a whole millisecond"


def _count(metrics: Metrics) -> float:
    return next(s.value for m in metrics.loop_lag.collect() for s in m.samples if s.name.endswith("_count"))


def test_the_sampler_slows_down_while_nothing_is_busy_and_comes_back() -> None:
    metrics = Metrics()
    busy = [True]
    seen: dict[str, float] = {}

    async def window(name: str, seconds: float) -> None:
        start = _count(metrics)
        await asyncio.sleep(seconds)
        seen[name] = _count(metrics) - start

    async def main() -> None:
        pace = metrics.watch_loop(lambda: busy[0], interval=0.005, idle_interval=0.2, idle_after=0.05)
        task = asyncio.create_task(pace)
        await window("busy", 0.3)  # ~60 samples
        busy[0] = False
        await asyncio.sleep(0.1)  # idle_after passes, and the last short sleep ends
        await window("idle", 0.6)  # ~3
        busy[0] = True
        await asyncio.sleep(0.25)  # the next slow wake-up finds it busy
        await window("back", 0.3)  # ~60 again
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    uvloop.run(main())
    assert seen["busy"] >= 20, seen
    assert seen["idle"] <= 4, seen
    assert seen["back"] >= 20, seen


def test_a_served_proxy_samples_fast_only_while_requests_come(make_proxy: Any, stub: Any) -> None:
    proxy = make_proxy(stub.url)
    metrics, state = proxy.state.metrics, proxy.state
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
    url = f"{proxy.url}/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=10).status_code == 200
    time.sleep(1.6)  # LAG_IDLE_AFTER_S without a request, and a slow interval more
    start = _count(metrics)
    time.sleep(1.0)
    idle = _count(metrics) - start
    assert not state.busy()

    slow = threading.Thread(
        target=lambda: httpx.post(url, json=body, headers={"x-stub-delay": "1.5"}, timeout=10)
    )
    slow.start()
    time.sleep(0.4)  # the request is in flight; the sampler's next slow wake-up has seen it
    assert state.busy()
    start = _count(metrics)
    time.sleep(0.8)
    during = _count(metrics) - start
    slow.join()
    assert idle <= 8, (idle, during)  # 4 a second
    assert during >= 20, (idle, during)  # 100 a second
