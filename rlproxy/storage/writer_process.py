"""The writer process: the SQL of `storage/writer.py`, run in a process of its own.

Started by the proxy (`storage/writer_link.py` says why and what travels), as
`python -m rlproxy.storage.writer_process FD`, FD one end of a socketpair. It runs the writer's
own loop (`Writer._run`: batches, one transaction each, retries and splits) on operations that
arrive as messages, and reports each settled batch back. Its signals are ignored (a Ctrl-C or a
SIGTERM to the process group reaches the proxy, which drains this process through a stop message);
the end of the socket ends it at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from rlproxy.storage.db import create_engine, writer_engine
from rlproxy.storage.journal import decode
from rlproxy.storage.writer import Writer, _Flush, _Item, _Op, _Reward, _Stop
from rlproxy.storage.writer_link import Framed, dump_error, encode_outcome

log = logging.getLogger("rlproxy.storage.writer")

STATS_EVERY_S = 0.25  # while a batch keeps failing, its error counters reach the proxy this often


class _Child(Writer):
    """A writer whose caller is the proxy at the other end of `link`."""

    def __init__(self, config: dict[str, Any], link: Framed) -> None:
        engine = create_engine(config["url"], busy_timeout_ms=config["busy_timeout_ms"])
        super().__init__(
            engine, flush_interval=config["flush_interval"], max_batch=config["max_batch"], thread=False
        )
        self._db = writer_engine(engine)
        self.link = link
        self._rewards: dict[int, _Reward] = {}
        self._sent: tuple | None = None

    def stats(self) -> tuple:
        return (*self.totals(), self.last_error)

    def take(self, msg: tuple) -> None:
        """One operation from the proxy, queued as the proxy's own writer would queue it."""
        try:
            self._take(msg)
        except Exception as exc:  # never the link's end: that one operation is given up
            log.exception("writer process: operation %r could not be queued", msg[:2])
            self._sent = self.stats()
            self.link.send(("give_up", [msg[1]], dump_error(exc), False, self._sent))

    def _take(self, msg: tuple) -> None:
        kind, key = msg[0], msg[1]
        op: _Op
        if kind == "I":
            payload = msg[2]
            op = _Item(decode(payload), len(payload), None, msg[3])
            op.key = key
            self._enqueue(op)
        elif kind == "R":
            # the outcome travels back to the proxy in the settle message; nothing here awaits the
            # future, so its exception (a 404, a 409) is retrieved at once, never logged by asyncio
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(_retrieved)
            op = _Reward(*msg[2:6], future, msg[6], msg[7])
            op.key, op.deadline = key, msg[8]
            self._rewards[key] = op
            self._put_soon(op)
        elif kind == "W":  # the proxy stopped waiting: not applied unless its transaction began
            reward = self._rewards.get(key)
            if reward is not None and not reward.future.done():
                reward.future.cancel()
        elif kind == "F":
            op = _Flush(asyncio.get_running_loop().create_future())
            op.key = key
            self._put_urgent(op)
        elif kind == "S":
            self._close_deadline = time.monotonic() + msg[2]
            op = _Stop()
            op.key = key
            self._put_urgent(op)

    def _settle(self, batch: list[_Op], results: list[Any]) -> None:
        pairs = [(op.key, encode_outcome(outcome)) for op, outcome in zip(batch, results, strict=True)]
        self._sent = self.stats()
        self.link.send(("settle", pairs, self._sent))
        for op in batch:
            self._rewards.pop(op.key, None)
        super()._settle(batch, results)

    def _give_up(self, batch: list[_Op], err: BaseException, keep: bool = False) -> None:
        self._sent = self.stats()
        self.link.send(("give_up", [op.key for op in batch], dump_error(err), keep, self._sent))
        for op in batch:  # the proxy logs and counts it; here only the queue's own bookkeeping
            self._pending -= 1
            self._rewards.pop(op.key, None)
            if isinstance(op, _Item):
                self._resolved(op)
        self._check_room()

    def _stopped(self) -> None:
        self.link.send(("stopped", self.stats()))
        super()._stopped()

    async def report(self) -> None:
        """Forever: the counters, when they changed without a settle (failed attempts)."""
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            now = self.stats()
            if now != self._sent:
                self._sent = now
                self.link.send(("stats", now))


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _idle_priority() -> None:
    """Run at the scheduler's idle priority (settings.writer_idle_priority).

    Why: on a box whose cores are all taken for a moment, a request's next process (the upstream, the
    client, the proxy itself) woken onto the core running a batch waited for the scheduler's wakeup
    granularity (~2 ms on 2 cores) behind this process's SQL. A SCHED_IDLE process yields at once, and
    its core counts as free when the scheduler places a woken task. The cost: it runs only on spare
    CPU. If it starves, the proxy raises it to the normal priority for a while, or, without
    CAP_SYS_NICE (which leaving SCHED_IDLE needs), replaces it with one started there
    (`Writer._watch_priority`).
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux, or refused: the normal priority then
        log.warning("writer process: idle priority not available (%s); running at normal priority", exc)


async def _serve(fd: int) -> None:
    loop = asyncio.get_running_loop()
    child: _Child | None = None
    started = loop.create_future()

    def on_message(msg: tuple) -> None:
        nonlocal child
        if child is not None:
            child.take(msg)
            return
        config = msg[1]  # the first message: ("config", {...})
        logging.basicConfig(
            level=config.get("log_level", logging.WARNING),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if config.get("idle_priority"):
            _idle_priority()
        child = _Child(config, link)
        started.set_result(child)

    def on_lost(exc: Exception | None) -> None:
        if child is None or child._task is None or not child._task.done():
            os._exit(0)  # the proxy is gone: what was not committed is in its journal (module doc)

    link = Framed(on_message, on_lost)
    await loop.create_unix_connection(lambda: link, sock=socket.socket(fileno=fd))
    writer = await started
    await writer.start()
    # What exists now (modules, SQLAlchemy's tables and dialect) lives as long as the process: out
    # of the collector's sight, a full collection walks only the batches' objects (it walked all of
    # it: ~40 ms per generation-2 pass, a tenth of this process's CPU under bench/proxy.py's load;
    # ~12 ms frozen)
    gc.collect()
    gc.freeze()
    reporter = asyncio.create_task(writer.report())
    try:
        await writer._task
    finally:
        reporter.cancel()
        await writer._discard_conn()
        await writer._db.dispose()
        await writer._engine.dispose()
    await asyncio.sleep(0)  # the last message is written on the next loop iteration
    if link.transport is not None:
        link.transport.close()  # after what is buffered is written


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    asyncio.run(_serve(int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
