"""The writer in a process of its own: the proxy's side (`ProcessRunner`, a `runner.Runner`) and
the child's (`_serve`), linked by `writer_link.py`.

Why a process (issue 24): with the writer on a thread, its SQL (SQLAlchemy statements, row
serialization, commits) held the serving interpreter's lock while requests waited: with SQL
switched off the serving process used ~0.1-0.15 ms less CPU per request and its p99 halved. A
thread later measured no worse on stub benchmarks (docs/performance.md); what keeps the process the
default is that only a process can run at the scheduler's idle priority (`runner.py` quotes the
numbers), and that it keeps the serving interpreter free when the store is slow.

The child is started as `python -m rlproxy.storage.writer_process FD`, FD one end of a socketpair,
and runs the batch loop (`runner.LoopRunner`) on the operations that arrive as messages. Its
signals are ignored (a Ctrl-C or a SIGTERM to the process group reaches the proxy, which drains it
through a stop message). It dies with its parent: at the end of its socket it exits at once, without
writing what it had not committed (that is in the crash journal, replayed by the next start). The
parent restarts a child that died and sends it again everything not settled (completions marked
replayed, so a row committed before the death is stored once).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from rlproxy.errors import StorageError
from rlproxy.storage.db import create_engine, writer_engine
from rlproxy.storage.journal import decode, encode
from rlproxy.storage.runner import (
    MAX_BACKOFF_S,
    REWARD_WAIT_S,
    Flush,
    Item,
    LoopRunner,
    Op,
    Report,
    Reward,
    Stop,
)
from rlproxy.storage.writer_link import Framed, WriterProcess, dump_error, load_error

log = logging.getLogger("rlproxy.storage.writer")


# A writer process at idle priority goes to the normal priority once it starves: runnable but not
# running for STARVED_SHARE of the last STARVED_SPAN_S, with operations waiting at every look (one
# each STARVE_CHECK_S). The kernel counts a wait when it ends, so a starved process's count moves in
# bursts: the span is several looks long. Under bench/proxy.py's loads it waits 10-30% of the time;
# under a busy loop on every core, most of it. Slow SQL (a locked store) is not runnable time: its
# busy handler sleeps. It is put back at idle priority IDLE_AGAIN_S later (doubled, up to
# IDLE_AGAIN_MAX_S, each time it starves again within IDLE_AGAIN_MAX_S of that).
STARVE_CHECK_S = 0.5
STARVED_SPAN_S = 2.0
STARVED_SHARE = 0.5
IDLE_AGAIN_S = 60.0
IDLE_AGAIN_MAX_S = 3600.0


class ProcessRunner:
    """The batches in a writer process (`runner.Runner`; the module doc says why), replaced
    when it dies and sent again every operation it had not settled, and, at the idle priority, moved
    to the normal one while it starves (`_watch_priority`)."""

    def __init__(self, recipe: dict[str, Any], flush_interval: float, max_batch: int, idle: bool) -> None:
        # the child at SCHED_IDLE only where the starvation watch can see the scheduler
        idle = idle and WriterProcess.can_watch()
        self._recipe = {**recipe, "flush_interval": flush_interval, "max_batch": max_batch}
        self._recipe["idle_priority"] = idle
        # a completion is sent within this (it is journaled): shorter than a batch's gathering
        self._item_wait = min(flush_interval, REWARD_WAIT_S) / 2
        self.child: WriterProcess | None = None
        self.restarts = 0  # writer processes that died and were replaced
        self._report: Report = lambda msg: None
        self._done: asyncio.Future[None] | None = None  # resolved by "stopped" (or a give-up)
        self._ops: dict[int, Op] = {}  # sent to the writer process, not settled yet (by key)
        self._next_key = 0
        self._spawned = 0  # writer processes started: from the second on, ops are sent "again"
        self._base = (0, 0, 0, 0, 0)  # counters of the writer processes before the current one
        self._stats: tuple = (0, 0, 0, 0, 0, None)  # the last ones reported, with the base
        self._deaths = 0  # writer processes lost in a row (the restart's backoff)
        self._close_deadline: float | None = None
        self._respawn: asyncio.Task[None] | None = None
        self._idle_wanted = idle  # the setting; `idle_priority` is the process's now
        self._watch: asyncio.TimerHandle | None = None  # `_watch_priority`, while idle is wanted
        # (when, its run-queue seconds) at the looks since operations last found none waiting
        self._waited: collections.deque[tuple[float, float]] = collections.deque()
        self._demoting = False  # the writer process is being replaced at normal priority
        self.idle_again_s = IDLE_AGAIN_S  # after its first starvation: back at idle priority this late
        self._idle_after = 0.0  # ...and after the last one (doubled while it keeps starving)
        self._idle_at: float | None = None  # when the normal priority ends (None: at idle priority)
        self._idle_since = time.monotonic()  # when it last went (or started) at idle priority

    @property
    def idle_priority(self) -> bool:
        return bool(self._recipe["idle_priority"])

    async def start(self, report: Report) -> None:
        self._report = report
        self._done = asyncio.get_running_loop().create_future()
        await self._spawn()

    async def join(self) -> None:
        await self._done
        if self.child is not None:
            self.child.close_link()
            await self.child.wait(10.0)

    def put(self, op: Op) -> None:
        self._next_key += 1
        op.key = self._next_key
        self._ops[op.key] = op
        if isinstance(op, Stop):
            self._close_deadline = op.deadline
        if isinstance(op, Item) and op.payload:
            op.rec = None  # the payload is what is sent, now and on a restart (see Item)
        if self.child is None or not self.child.connected:
            return  # sent by `_spawn` once a process is there
        wire = self._wire(op, False)
        if wire is not None:  # a completion is journaled: it may wait for the next batch's send
            self.child.send(wire, self._item_wait if isinstance(op, Item) else 0.0)

    async def _spawn(self) -> None:
        """Start a writer process and send it every operation not settled yet, in order."""
        self.child = WriterProcess()
        config = {**self._recipe, "log_level": logging.getLogger().getEffectiveLevel()}
        await self.child.spawn(config, Framed(self._from_child, self._child_lost))
        again = self._spawned > 0  # a dead (or replaced) process may have committed some of them
        self._spawned += 1
        self._waited.clear()
        self._demoting = False  # (a process that died before its kill was lost as a death)
        if self._idle_at is not None:  # started at the normal priority (the last one starved): its
            # time there counts from now, not from the decision (a start can take seconds on a
            # loaded box: counted from the decision, it went back to idle priority, starved at once)
            self._idle_at = time.monotonic() + self._idle_after
        if self._idle_wanted and self._watch is None:
            self._watch = asyncio.get_running_loop().call_later(STARVE_CHECK_S, self._watch_priority)
        for op in list(self._ops.values()):
            wire = self._wire(op, again)
            if wire is not None:
                self.child.send(wire)

    def _wire(self, op: Op, again: bool) -> tuple | None:
        """`op` as a message for the writer process (None: given up, it cannot be sent)."""
        if isinstance(op, Item):
            try:
                payload = op.payload or encode(op.rec)
            except (TypeError, ValueError) as exc:  # not even a sanitized copy (submit logged why)
                del self._ops[op.key]
                self._report(("give_up", [op], StorageError(f"not serializable: {exc}"), False, self._stats))
                return None
            return ("I", op.key, payload, op.replayed or again)
        if isinstance(op, Reward):
            fields = (op.run_id, op.reward, op.metrics, op.metadata, op.rubric, op.split, op.deadline)
            return ("R", op.key, *fields)
        return ("F", op.key) if isinstance(op, Flush) else ("S", op.key, op.deadline)

    def _from_child(self, msg: tuple) -> None:
        """A message of the writer process: what it settled or gave up, by key, reported as ops."""
        try:
            kind = msg[0]
            self._stats = stats = (*(b + n for b, n in zip(self._base, msg[-1][:5], strict=True)), msg[-1][5])
            if kind == "settle":
                self._deaths = 0
                pairs = [(op, out) for key, out in msg[1] if (op := self._ops.pop(key, None)) is not None]
                outcomes = [load_error(out) if isinstance(out, tuple) else out for _, out in pairs]
                self._report(("settle", [op for op, _ in pairs], outcomes, stats))
            elif kind == "give_up":
                ops = [op for key in msg[1] if (op := self._ops.pop(key, None)) is not None]
                self._report(("give_up", ops, load_error(msg[2]), msg[3], stats))
            elif kind == "stopped":
                for key in [k for k, op in self._ops.items() if isinstance(op, Stop)]:
                    del self._ops[key]
                self._report(("stopped", stats))
                if not self._done.done():
                    self._done.set_result(None)
            else:
                self._report(("stats", stats))
        except Exception:  # a bug here must not end the link (and with it the writer process)
            log.exception("writer: a message of the writer process could not be handled")

    def _watch_priority(self) -> None:
        """Every STARVE_CHECK_S while idle priority is wanted: at idle priority, move the writer
        process to the normal one once it starves (see STARVED_SHARE); at the normal one, put it
        back at idle priority when its time there is over (see IDLE_AGAIN_S; why idle: `_idle_priority`).
        Lowering it is always allowed; raising it needs CAP_SYS_NICE, and without that the process
        is replaced by one started at the normal priority (the kill -9 path: nothing lost, each row
        once)."""
        self._watch = None
        if self._done is None or self._done.done() or not self._idle_wanted:
            return
        self._watch = asyncio.get_running_loop().call_later(STARVE_CHECK_S, self._watch_priority)
        child = self.child
        if child is None or not child.connected or self._demoting:
            self._waited.clear()
            return
        now = time.monotonic()
        if self._idle_at is not None:  # at the normal priority since it starved
            if now >= self._idle_at and child.set_idle(True):
                log.info(
                    "writer process: back at idle priority after %.0f s at the normal one",
                    self._idle_after,
                )
                self._recipe["idle_priority"] = True
                self._idle_at = None
                self._idle_since = now
            return
        waited = child.waited()
        looks = self._waited
        if waited is None or not self._ops:
            looks.clear()
            return
        looks.append((now, waited))
        while len(looks) > 1 and now - looks[1][0] >= STARVED_SPAN_S:
            looks.popleft()
        span = now - looks[0][0]
        share = (waited - looks[0][1]) / span if span > 0 else 0.0
        if span < STARVED_SPAN_S or share < STARVED_SHARE:
            return
        again = self._idle_after > 0 and now - self._idle_since < IDLE_AGAIN_MAX_S
        self._idle_after = min(2 * self._idle_after, IDLE_AGAIN_MAX_S) if again else self.idle_again_s
        self._idle_at = now + self._idle_after
        self._recipe["idle_priority"] = False  # a process started from now on: the normal priority
        looks.clear()
        raised = child.set_idle(False)
        log.warning(
            "writer process: starved at idle priority (runnable but not running %.0f%% of the last"
            " %.1f s, %d operations waiting); %s; idle priority again in %.0f s",
            100 * share,
            span,
            len(self._ops),
            "now at the normal priority" if raised else "replacing it with one at the normal priority",
            self._idle_after,
        )
        if not raised:
            self._demoting = True
            child.kill()  # what it had not settled is sent again to the next one, as after a crash

    def _child_lost(self, exc: Exception | None) -> None:
        """The writer process's socket ended: expected after "stopped", else the process died."""
        if self._done is None or self._done.done():
            return
        self._base = self._stats[:5]
        if self._demoting:  # `_watch_priority` ended it: not a death
            self._demoting = False
        else:
            self._deaths += 1
            self.restarts += 1
            code = self.child.returncode() if self.child is not None else None
            log.error(
                "writer process exited (code %s) with %d operations not settled; starting another",
                code,
                len(self._ops),
            )
        self._respawn = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        if self.child is not None:
            await self.child.wait(5.0)
        while True:
            await asyncio.sleep(min(0.1 * 2 ** (self._deaths - 1), MAX_BACKOFF_S))
            if self._close_deadline is not None and time.monotonic() > self._close_deadline:
                died = StorageError("the writer process died")
                self._report(("give_up", list(self._ops.values()), died, True, self._stats))
                self._ops.clear()
                self._done.set_result(None)
                return
            try:
                await self._spawn()
                return
            except OSError as e:  # out of processes or descriptors: try again
                self._deaths += 1
                log.error("writer: cannot start a writer process: %s", e)


def _op(msg: tuple) -> Op:
    """One operation from the proxy (writer_link.py's wire), as the proxy's writer queued it."""
    kind, key = msg[0], msg[1]
    op: Op
    if kind == "I":
        op = Item(decode(msg[2]), len(msg[2]), None, msg[3])
    elif kind == "R":  # its future is never resolved here: the outcome travels in the report
        op = Reward(*msg[2:6], asyncio.get_running_loop().create_future(), msg[6], msg[7], deadline=msg[8])
    elif kind == "F":
        op = Flush(asyncio.get_running_loop().create_future())
    else:
        op = Stop(msg[2])
    op.key = key
    return op


def _keyed(msg: tuple) -> tuple:
    """A report of the runner with keys for its operations (writer_link.py's wire)."""
    if msg[0] == "settle":
        outcomes = [dump_error(o) if isinstance(o, BaseException) else o for o in msg[2]]
        return ("settle", [(op.key, o) for op, o in zip(msg[1], outcomes, strict=True)], msg[-1])
    if msg[0] == "give_up":
        return ("give_up", [op.key for op in msg[1]], dump_error(msg[2]), msg[3], msg[-1])
    return msg


def _idle_priority() -> None:
    """Run at the scheduler's idle priority (settings.writer_idle_priority).

    Why: on a box whose cores are all taken for a moment, a request's next process (the upstream, the
    client, the proxy itself) woken onto the core running a batch waited for the scheduler's wakeup
    granularity (~2 ms on 2 cores) behind this process's SQL. A SCHED_IDLE process yields at once, and
    its core counts as free when the scheduler places a woken task. The cost: it runs only on spare
    CPU (a trainer or an engine on the cores, a burst of load): `ProcessRunner._watch_priority`.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux, or refused: the normal priority then
        log.warning("writer process: idle priority not available (%s); running at normal priority", exc)


async def _serve(fd: int) -> None:
    loop = asyncio.get_running_loop()
    runner: LoopRunner | None = None
    started = loop.create_future()

    def on_message(msg: tuple) -> None:
        nonlocal runner
        if runner is not None:
            try:
                runner.put(_op(msg))
            except Exception as exc:  # never the link's end: that one operation is given up
                log.exception("writer process: operation %r could not be queued", msg[:2])
                link.send(("give_up", [msg[1]], dump_error(exc), False, runner.stats()))
            return
        config = msg[1]  # the first message: ("config", {...})
        logging.basicConfig(
            level=config.get("log_level", logging.WARNING),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if config.get("idle_priority"):
            _idle_priority()
        engine = create_engine(config["url"], busy_timeout_ms=config["busy_timeout_ms"])
        db = writer_engine(engine)
        runner = LoopRunner(db, config["flush_interval"], config["max_batch"])
        started.set_result((runner, db, engine))

    def on_lost(exc: Exception | None) -> None:
        if runner is None or runner.task is None or not runner.task.done():
            os._exit(0)  # the proxy is gone: what was not committed is in its journal (module doc)

    link = Framed(on_message, on_lost)
    await loop.create_unix_connection(lambda: link, sock=socket.socket(fileno=fd))
    writer, db, engine = await started
    await writer.start(lambda msg: link.send(_keyed(msg)))
    # What exists now (modules, SQLAlchemy's tables and dialect) lives as long as the process: out
    # of the collector's sight, a full collection walks only the batches' objects (it walked all of
    # it: ~40 ms per generation-2 pass, a tenth of this process's CPU under bench/proxy.py's load;
    # ~12 ms frozen)
    gc.collect()
    gc.freeze()
    try:
        await writer.join()
    finally:
        await db.dispose()
        await engine.dispose()
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
