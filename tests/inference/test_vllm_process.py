"""A launched server never outlives `serve`: the process-group handling of vllm_process.py, driven with
a stand-in command (a shell that starts a child, like vLLM's API server and its engine core) so the
guarantee is tested in seconds. The real vLLM is launched the same way (tests/inference/test_vllm.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# The stand-in for vLLM: a leader that starts a child, both sleeping; prints both pids.
STAND_IN = "sleep 600 & echo $$ $!; wait"

PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from rlproxy.inference.vllm_process import VLLMProcess
    proc = VLLMProcess(["sh", "-c", sys.argv[1]], {"PATH": "/usr/bin:/bin"}, Path(sys.argv[2]))
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes (its parent, the killed process, is gone or reaped by init)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _pids(log: Path, timeout: float = 20.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        words = log.read_text().split() if log.exists() else []
        if len(words) >= 2:
            return int(words[0]), int(words[1])
        time.sleep(0.05)
    raise AssertionError(f"the stand-in never wrote its pids to {log}")


def _gone(pids: tuple[int, ...], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_sigkill_of_the_parent_kills_the_launched_group(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, STAND_IN, str(log)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        leader, child = _pids(log)
        assert _alive(leader) and _alive(child)
        parent.send_signal(signal.SIGKILL)  # no atexit, no finally: only the kernel closes its pipe
        parent.wait()
        assert _gone((leader, child)), "the launched process group outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()


def test_clean_stop_disarms_the_reaper(tmp_path: Path) -> None:
    from rlproxy.inference.vllm_process import VLLMProcess

    proc = VLLMProcess(["sh", "-c", STAND_IN], {"PATH": "/usr/bin:/bin"}, tmp_path / "vllm.log")
    leader, child = _pids(tmp_path / "vllm.log")
    reaper = proc._reaper
    assert reaper is not None and reaper.poll() is None
    asyncio.run(proc.stop())
    assert _gone((leader, child))
    assert reaper.wait(timeout=5) == 0  # disarmed: it exited on the byte, it did not kill


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_parent_dying_of_a_signal_it_does_not_handle_leaves_nothing(tmp_path: Path, sig: int) -> None:
    log = tmp_path / "vllm.log"
    # the default disposition is set before "ready": a signal sent earlier would find the one inherited
    # (pytest-xdist's workers ignore SIGINT, and so would the parent, sleeping out its 600 s)
    code = PARENT.replace(
        'print("ready", flush=True)',
        f'import signal; signal.signal({int(sig)}, signal.SIG_DFL); print("ready", flush=True)',
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, STAND_IN, str(log)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        leader, child = _pids(log)
        parent.send_signal(sig)
        parent.wait()
        assert _gone((leader, child))
    finally:
        parent.kill()
        parent.wait()
