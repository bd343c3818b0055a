"""The training hold gate: with `blocking_train`, new requests wait (not fail) while a step trains.

On a single GPU the trainer and the inference server compete for memory; holding new requests for
the few seconds a step takes is kinder than failing them. The trainer calls `set_training(True)` /
`set_training(False)` (through `on_train_state`), possibly from its worker thread.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


class TrainGate:
    """Open unless `enabled` and the trainer said it is training."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._open = asyncio.Event()
        self._open.set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Remember the event loop so a trainer thread can flip the gate safely."""
        self._loop = loop

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def set_training(self, training: bool) -> None:
        """The trainer's `on_train_state` callback; safe to call from any thread."""
        if not self.enabled:
            return
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is not loop:
            loop.call_soon_threadsafe(self._apply, training)
        else:
            self._apply(training)

    def _apply(self, training: bool) -> None:
        if training:
            logger.info("training step started: holding new requests")
            self._open.clear()
        else:
            self._open.set()

    async def wait(self) -> None:
        """Return when the gate is open."""
        await self._open.wait()
