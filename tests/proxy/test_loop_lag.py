"""`rlproxy_event_loop_lag_seconds` (proxy/metrics.py `watch_loop`) on the loop `serve` runs: uvloop.

A stall is recorded at its length, and an idle loop's samples have sub-millisecond resolution:
read from `loop.time()` they were libuv's cached millisecond, so every sample was a whole number of
milliseconds (an idle proxy's 1.0 ms samples filled the 2 ms bucket).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

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
