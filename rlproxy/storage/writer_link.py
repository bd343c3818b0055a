"""The link to a writer process (`writer_process.py`): spawn it, frame messages both ways, watch
its scheduling (`WriterProcess`).

The wire: a `socket.socketpair()`, each message one frame, `<u32 length><pickle>`, both ends ours.
Parent -> child: ("config", {...}) first, then the operations ("I" completion, "R" reward, "F" flush,
"S" stop), each with the key the parent settles it by (a reward and a stop carry their deadline).
Child -> parent: the runner's reports (`runner.py`) with keys for operations. Completions are
written to the child within half of `flush_interval` or of REWARD_WAIT_S, whichever is shorter (25
ms by default: the writer gathers a batch longer than that anyway, and each completion is in the
crash journal already), everything else at once, each time in one write: at one request in flight,
a write and a wake-up of the child per completion cost more CPU than the SQL itself.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rlproxy.storage.writer")  # the writer's messages, whichever file

_LEN = struct.Struct("<I")
MAX_FRAME = 1 << 30  # one message; a completion is bounded far below this (max_body_bytes)


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
