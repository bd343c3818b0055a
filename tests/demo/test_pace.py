"""demo/pace.py: a demo on a busy machine extends its time once, up to the ceiling, and when it
still falls short says why (its CPU share, the groups skipped and their reason) and what next;
a quiet machine never extends (issue 56: `make demo` with two busy loops missed its goal silently)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from rlproxy.demo.pace import CEILING_MINUTES, CpuShare, extend_to, shortfall


def test_only_a_busy_machine_extends_and_only_to_the_ceiling():
    quiet = {"share": 0.97, "others_cores": 0.1, "cores": 2.0}
    busy = {"share": 0.55, "others_cores": 1.8, "cores": 2.0}
    assert extend_to(10.0, quiet) is None  # the quiet-box demo is unchanged
    assert extend_to(10.0, busy) == CEILING_MINUTES == 15.0
    assert extend_to(CEILING_MINUTES, busy) is None  # once, never past the ceiling


def test_the_shortfall_says_why_and_what_next():
    rows = [{"status": "trained"}] * 5 + [{"status": "skipped", "reason": "zero_variance"}] * 3
    summary = {"minutes": 15.0, "improvement": 0.28, "rows": rows}
    summary["cpu"] = {"share": 0.61, "others_cores": 1.6, "cores": 2.0}
    text = shortfall(summary, 0.5)
    assert "not reached in 15.0 min (+0.280" in text
    assert "the demo got 61% of the CPU" in text and "1.6 of 2 cores" in text
    assert "3 of 8 groups not trained (zero_variance): every episode of the group got the same reward" in text
    assert "stop the other work" in text
    summary["cpu"] = {"share": 0.98, "others_cores": 0.0, "cores": 2.0}
    assert "--minutes 20" in shortfall(summary, 0.5) and "stop the other work" not in shortfall(summary, 0.5)


def _busy_loop() -> int:
    """The pid of a busy loop that is another process's work, not a child of this one (CpuShare counts
    this process's children as the demo's): the shell starts it in the background and exits, so init
    adopts it."""
    out = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.strip())


def test_cpu_share_sees_a_busy_loop_beside_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    busy = _busy_loop()
    try:
        share = CpuShare(child.pid)
        time.sleep(1.5)
        seen = share.read()
    finally:
        os.kill(busy, signal.SIGKILL)
        child.kill()
    assert seen["others_cores"] >= 0.5, seen  # the loop kept about a core busy
    assert 0.0 <= seen["share"] <= 0.5 and seen["cores"] == float(os.cpu_count() or 1)


def test_the_server_is_counted_once():
    # `serve` is both the demo's child and the `pid` CpuShare is given: counted twice, a busy server
    # beside a busy loop read as the whole machine (share 1.0, others 0: a busy box never extended)
    server = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    busy = _busy_loop()
    try:
        cpu = psutil.Process(server.pid).cpu_times
        before, machine0 = sum(cpu()[:2]), CpuShare._machine()
        share = CpuShare(server.pid)
        time.sleep(2.0)
        seen = share.read()
        alone = (sum(cpu()[:2]) - before) / (CpuShare._machine() - machine0)  # the server's own share
    finally:
        os.kill(busy, signal.SIGKILL)
        server.kill()
    assert abs(seen["share"] - alone) < 0.15 and seen["others_cores"] >= 0.4, (seen, alone)
