"""The proxy's side of its writer process (`ProcessRunner`): spawn it, frame messages both ways,
replace it when it dies, watch it starve at the idle priority.

Why a process (issue 24): with the writer on a thread, its SQL (SQLAlchemy statements, row
serialization, commits) held the interpreter lock while requests waited for it: with SQL switched
off the serving process used ~0.1-0.15 ms less CPU per request and its p99 halved. A thread later
measured no worse on stub benchmarks (docs/performance.md); what keeps the process the default is
that only a process can run at the scheduler's idle priority (`runner.py` quotes the numbers), and
that it keeps the serving interpreter free when the store is slow. `writer_process.py` is the
child's side.

The wire: a `socket.socketpair()`, each message one frame, `<u32 length><pickle>`, both ends ours.
Parent -> child: ("config", {...}) first, then the operations ("I" completion, "R" reward, "F" flush,
"S" stop), each with the key the parent settles it by (a reward and a stop carry their deadline).
Child -> parent: the runner's reports (`runner.py`) with keys for operations. Completions are
written to the child within half of `flush_interval` or of REWARD_WAIT_S, whichever is shorter (25
ms by default: the writer gathers a batch longer than that anyway, and each completion is in the
crash journal already), everything else at once, each time in one write: at one request in flight,
a write and a wake-up of the child per completion cost more CPU than the SQL itself.

The child dies with its parent: at the end of its socket it exits at once, without writing what it
had not committed (that is in the crash journal, replayed by the next start). The parent restarts a
child that died and sends it again everything not settled (completions marked replayed, so a row
committed before the death is stored once).
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from rlproxy.errors import StorageError
from rlproxy.storage.journal import encode
from rlproxy.storage.runner import MAX_BACKOFF_S, REWARD_WAIT_S, Flush, Item, Op, Report, Reward, Stop

log = logging.getLogger("rlproxy.storage.writer")  # the writer's messages, whichever file

_LEN = struct.Struct("<I")
MAX_FRAME = 1 << 30  # one message; a completion is bounded far below this (max_body_bytes)
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


def frame(msg: Any) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def dump_error(exc: BaseException) -> tuple:
    """An exception as plain data (ours take other constructor arguments than their `args`)."""
    return ("exc", type(exc).__module__, type(exc).__qualname__, exc.args, dict(vars(exc)))


def load_error(data: tuple) -> BaseException:
    """The exception `dump_error` described (a RuntimeError naming it if its class is unknown here)."""
    _, module, name, args, state = data
    try:
        cls: Any = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(name)
        exc = cls.__new__(cls)
        exc.args = args
        vars(exc).update(state)
        return exc
    except Exception:
        return RuntimeError(f"{module}.{name}: {args[0] if args else ''}")


def encode_outcome(outcome: Any) -> Any:
    return dump_error(outcome) if isinstance(outcome, BaseException) else outcome


def decode_outcome(outcome: Any) -> Any:
    return load_error(outcome) if isinstance(outcome, tuple) else outcome


class Framed(asyncio.Protocol):
    """One end of the link: whole messages to `on_message`, the end to `on_lost`."""

    def __init__(
        self, on_message: Callable[[Any], None], on_lost: Callable[[Exception | None], None]
    ) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0
        while len(buf) - start >= 4:
            (n,) = _LEN.unpack_from(buf, start)
            if n > MAX_FRAME:
                log.error("writer link: a frame of %d bytes; closing the link", n)
                self.transport.close()
                return
            if len(buf) - start - 4 < n:
                break
            msg = pickle.loads(memoryview(buf)[start + 4 : start + 4 + n])
            start += 4 + n
            self.on_message(msg)
        if start:
            del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.on_lost(exc)

    def send(self, msg: Any, within: float = 0.0) -> None:
        """Queue `msg`, to be written within `within` seconds (0: in this loop iteration) together
        with everything else queued by then: one write, and one wake-up of the other end."""
        if self.closed:
            return
        loop = self.loop  # the caller's: the writer's `submit` runs on it
        self._out.append(frame(msg))
        if within <= 0:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if not self._scheduled:
                self._scheduled = True
                loop.call_soon(self._write)
        elif not self._scheduled and self._timer is None:
            self._timer = loop.call_later(within, self._write)

    def _write(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        out, self._out = self._out, []
        if out and not self.closed and self.transport is not None:
            self.transport.write(b"".join(out))


class WriterProcess:
    """The child process and the parent's end of its link (see the module doc)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.link: Framed | None = None

    async def spawn(self, config: dict[str, Any], link: Framed) -> None:
        """Start a child, connect `link` to it and send it `config` (returns without waiting for it
        to be ready: what is sent meanwhile waits in the socket)."""
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlproxy.storage.writer_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        await asyncio.get_running_loop().create_unix_connection(lambda: link, sock=ours)
        self.link = link
        link.send(("config", config))

    def send(self, msg: Any, within: float = 0.0) -> None:
        if self.link is not None:
            self.link.send(msg, within)

    @property
    def connected(self) -> bool:
        return self.link is not None and not self.link.closed

    @staticmethod
    def can_watch() -> bool:
        """Whether `waited` can tell (Linux with the scheduler's statistics)."""
        return os.path.exists("/proc/self/schedstat")

    def waited(self) -> float | None:
        """Seconds the child has been runnable but not running, in all (None: not known)."""
        if self.proc is None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/schedstat", "rb") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    def set_idle(self, idle: bool) -> bool:
        """Put the child at the scheduler's idle (True) or normal (False) priority from here; False
        if refused. Lowering another process of the same user is always allowed; raising one out of
        SCHED_IDLE takes CAP_SYS_NICE (or a RLIMIT_NICE that allows nice 0)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        pid = self.proc.pid
        try:  # every thread: the policy is a thread's (today the child has one; a driver may add some)
            threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except (OSError, ValueError):
            threads = [pid]
        try:
            policy, param = (os.SCHED_IDLE if idle else os.SCHED_OTHER), os.sched_param(0)
            for tid in threads:
                try:
                    os.sched_setscheduler(tid, policy, param)
                except ProcessLookupError:  # a thread that just ended
                    continue
        except (AttributeError, OSError):  # not Linux, refused, or the process just ended
            return False
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    async def wait(self, timeout: float) -> int | None:
        """Wait for the child to exit (killed after `timeout` seconds); its exit code."""
        proc = self.proc
        if proc is None:
            return None
        try:
            return await asyncio.to_thread(proc.wait, timeout)
        except subprocess.TimeoutExpired:
            log.warning("writer process %d did not exit; killing it", proc.pid)
            proc.kill()
            return await asyncio.to_thread(proc.wait)

    def close_link(self) -> None:
        if self.link is not None and self.link.transport is not None:
            self.link.transport.close()


class ProcessRunner:
    """The batches in a writer process (`runner.Runner`; the module doc says why and how), replaced
    when it dies and sent again every operation it had not settled, and, at the idle priority, moved
    to the normal one while it starves (`_watch_priority`)."""

    def __init__(self, recipe: dict[str, Any], flush_interval: float, max_batch: int, idle: bool) -> None:
        # writer_process.py: SCHED_IDLE, where the starvation watch can see the scheduler
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
                pairs = [(op, decode_outcome(out)) for key, out in msg[1] if (op := self._ops.pop(key, None))]
                self._report(("settle", [op for op, _ in pairs], [out for _, out in pairs], stats))
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
        back at idle priority when its time there is over (see IDLE_AGAIN_S).

        The idle priority keeps its SQL from delaying requests on a busy core (docs/performance.md);
        where the cores are kept busy (a trainer or an engine on them, a burst of load) it gets only
        their leftovers. Lowering it is always allowed. Raising it from here needs CAP_SYS_NICE;
        without that, the process is replaced by one started at the normal priority (over the kill -9
        path: nothing lost, each row once)."""
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
