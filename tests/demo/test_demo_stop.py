"""A command that starts servers stops them however it is stopped (issue 56): `rlproxy demo`
stopped by SIGTERM (`timeout`, a CI runner, systemd) or killed outright leaves no `serve` running.
Before, SIGTERM ended the demo and its `serve`, in a session of its own, went on training."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

RLPROXY = Path(sys.executable).with_name("rlproxy")


def _serve_child(demo: subprocess.Popen, timeout: float = 120.0) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert demo.poll() is None, demo.communicate()
        for child in psutil.Process(demo.pid).children():
            if "serve" in child.cmdline():
                return child
        time.sleep(0.2)
    raise AssertionError("the demo started no serve")


def _gone(proc: psutil.Process, timeout: float) -> bool:
    try:
        proc.wait(timeout=timeout)
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_demo_leaves_no_serve(tmp_path, sig):
    exe = [str(RLPROXY)] if RLPROXY.exists() else [sys.executable, "-m", "rlproxy.cli"]
    demo = subprocess.Popen(
        [*exe, "demo", "--fast", "--out-dir", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    serve = None
    try:
        serve = _serve_child(demo)
        time.sleep(1.0)  # serve is past its start (its signal handlers set), not yet healthy
        demo.send_signal(sig)
        assert _gone(serve, 60), "serve outlived its demo"
        demo.wait(timeout=60)
    finally:
        for proc in (demo, serve):
            try:
                if proc is not None:
                    proc.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
