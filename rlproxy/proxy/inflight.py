"""Requests of each run still on their way to the writer.

A reward for a run must see every completion of that run that the client has already received.
Every record is submitted (journaled, then queued) before its response's last byte goes out, but a
client can post the reward while another request of the same run is still running (a stream still
relaying). `InFlight` counts requests per run from arrival until their record is submitted; the
reward route waits a bounded time for zero, then answers 503 (retryable).
"""

from __future__ import annotations

import asyncio


class InFlight:
    """Per-run counters of requests not yet submitted to the writer."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}

    def enter(self, run_id: str) -> None:
        """A request of `run_id` arrived."""
        self._count[run_id] = self._count.get(run_id, 0) + 1

    def leave(self, run_id: str) -> None:
        """Its record was submitted (or it failed before one existed)."""
        n = self._count.get(run_id, 0) - 1
        if n > 0:
            self._count[run_id] = n
            return
        self._count.pop(run_id, None)
        event = self._idle.pop(run_id, None)
        if event is not None:
            event.set()

    def busy(self, run_id: str) -> int:
        """How many requests of `run_id` are in flight."""
        return self._count.get(run_id, 0)

    async def wait_idle(self, run_id: str, timeout: float) -> bool:
        """Wait until no request of `run_id` is in flight; False if `timeout` seconds passed first."""
        while self._count.get(run_id, 0) > 0:
            event = self._idle.setdefault(run_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                return False
        return True
