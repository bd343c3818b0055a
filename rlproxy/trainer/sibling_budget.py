"""The siblings' budget: how many sibling requests may be in flight, when the next may start, and the
share of engine time they took (docs/siblings.md, "Budget").

    await budget.acquire()      waits for a free slot, the slot's pause, and (a while) for the app
    ... one request of t seconds on the engine ...
    budget.release(t)           the slot rests t * (m - s) / s before it takes the next request

With m = `siblings_max_inflight` slots and s = `siblings_max_share`, a slot is busy at most s / m of
the time, so all of them together keep the engine busy with siblings at most s of the wall time,
however their requests overlap (m = 1: after a request of t seconds, wait t * (1 - s) / s). The time
counted is a request's whole wall time, its wait behind app requests on the engine included: the
bound is conservative.

App requests go first twice over: a slot waits while the proxy has requests in flight (`app_busy`,
compose passes `Limits.in_flight`), for at most `APP_WAIT_MAX` seconds so that steady traffic cannot
starve siblings for ever, and every sibling request carries a low engine priority (`resample`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

APP_WAIT_MAX = 5.0  # seconds a slot waits for the app's requests to finish before it goes anyway
APP_POLL = 0.02  # seconds between two looks at the app's requests in flight
WINDOW = 60.0  # seconds over which `share` is measured


class Budget:
    """Slots, pacing and the engine-time share of sibling requests (all on the event loop)."""

    def __init__(
        self,
        max_inflight: int,
        max_share: float,
        app_busy: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_inflight = max_inflight
        self.max_share = max_share
        self.app_busy = app_busy
        self.clock = clock
        self.in_flight = 0
        self.engine_seconds = 0.0  # sibling request time, summed over requests
        self._slots = asyncio.Semaphore(max_inflight)
        self._busy_since: float | None = None  # start of the current stretch with a request in flight
        self._stretches: collections.deque[tuple[float, float]] = collections.deque()  # (start, end)

    @property
    def pause_factor(self) -> float:
        """A slot rests this many times the length of its last request."""
        return (self.max_inflight - self.max_share) / self.max_share

    async def acquire(self) -> None:
        """Take a slot: once one is free and, for a while, once the app has nothing in flight."""
        await self._slots.acquire()
        if self.app_busy is not None:
            deadline = self.clock() + APP_WAIT_MAX
            while self.app_busy() and self.clock() < deadline:
                await asyncio.sleep(APP_POLL)
        if self.in_flight == 0:
            self._busy_since = self.clock()
        self.in_flight += 1

    def release(self, seconds: float) -> None:
        """Give the slot back after a request of `seconds`, once it has rested its pause."""
        self.in_flight -= 1
        self.engine_seconds += seconds
        if self.in_flight == 0 and self._busy_since is not None:
            self._stretches.append((self._busy_since, self.clock()))
            self._busy_since = None
        asyncio.get_running_loop().call_later(seconds * self.pause_factor, self._slots.release)

    def share(self) -> float:
        """The share of the last `WINDOW` seconds with a sibling request in flight (0..1)."""
        now = self.clock()
        start = now - WINDOW
        while self._stretches and self._stretches[0][1] < start:
            self._stretches.popleft()
        busy = sum(min(b, now) - max(a, start) for a, b in self._stretches if b > start)
        if self._busy_since is not None:
            busy += now - max(self._busy_since, start)
        return max(0.0, min(1.0, busy / WINDOW))
