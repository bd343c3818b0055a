"""Issue 9, case 6 ("loss on kill -9"): every response a client received in full is in the store
after `rlproxy serve` is killed with SIGKILL under load and started again on the same database.

32 concurrent clients (stream and not, each request its own run id as the marker) drive a real
`rlproxy serve` subprocess in front of a stub upstream (5 ms per answer: the test is about the
proxy). After a few seconds the server gets SIGKILL while requests are in flight; a second `serve`
on the same database replays the crash journal before it prints its ready line; then every marker a
client received in full must be in `completions`, exactly once.

CI keeps it short; the acceptance figures come from the long form:

    RLPROXY_KILL9_SECONDS=30 RLPROXY_KILL9_RUNS=5 pytest -s tests/proxy/test_kill9.py
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
from proxy_helpers import ROOT, free_port

SECONDS = float(os.environ.get("RLPROXY_KILL9_SECONDS", "5"))
RUNS = int(os.environ.get("RLPROXY_KILL9_RUNS", "1"))
CONCURRENCY = int(os.environ.get("RLPROXY_KILL9_CONCURRENCY", "32"))
BIN = Path(sys.executable).parent


def _wait_line(proc: subprocess.Popen, needle: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} line (exit code {proc.poll()})")


def _serve(db: Path, upstream: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "rlproxy"), "serve", "--backend", "vllm", "--upstream", upstream, "--model", "stub-model"]
        + ["--no-train", "--port", str(port), "--db", str(db), "--no-access-log", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    line = _wait_line(proc, "OPENAI_BASE_URL=")
    return proc, line.split("OPENAI_BASE_URL=", 1)[1].strip().removesuffix("/v1")


async def _load(base: str, proc: subprocess.Popen, seconds: float) -> tuple[set[str], int]:
    """Clients until SIGKILL; the markers received in full, and how many requests did not finish."""
    received: set[str] = set()
    failed = 0
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)

    async def worker(client: httpx.AsyncClient, w: int) -> None:
        nonlocal failed
        j = 0
        while not stop.is_set():
            marker, stream = f"k-{w}-{j}", (w + j) % 2 == 0
            j += 1
            body = {
                "model": "stub-model",
                "messages": [{"role": "user", "content": marker}],
                "stream": stream,
            }
            try:
                if stream:
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=body, headers={"X-Run-Id": marker}
                    ) as r:
                        data = b"".join([chunk async for chunk in r.aiter_bytes()])
                    if r.status_code == 200 and b"data: [DONE]" in data:
                        received.add(marker)
                else:
                    r = await client.post("/v1/chat/completions", json=body, headers={"X-Run-Id": marker})
                    if r.status_code == 200 and r.json()["choices"]:
                        received.add(marker)
            except (httpx.HTTPError, ValueError):
                failed += 1
                await asyncio.sleep(0.01)

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=10) as client:
        workers = [asyncio.create_task(worker(client, w)) for w in range(CONCURRENCY)]
        await asyncio.sleep(seconds)
        os.kill(proc.pid, signal.SIGKILL)  # mid-load: requests are in flight
        stop.set()
        await asyncio.gather(*workers)
    return received, failed


def test_kill9_loses_no_received_response(tmp_path: Path) -> None:
    """Case 6: 0 of the responses clients received in full are missing after kill -9 + restart."""
    env = {**os.environ, "RLPROXY_CACHE_DIR": str(tmp_path / "cache")}
    stub = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "stub_upstream.py"),
            "--port",
            str(free_port()),
            "--delay",
            "0.005",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        upstream = _wait_line(stub, "stub upstream at", 30).split(" at ", 1)[1].split()[0]
        for run in range(RUNS):
            db = tmp_path / f"kill9-{run}.db"
            proc, base = _serve(db, upstream, env)
            try:
                received, failed = asyncio.run(_load(base, proc, SECONDS))
            finally:
                proc.kill()
                proc.wait(30)
            again, _ = _serve(db, upstream, env)  # ready = the journal is replayed and committed
            try:
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
                stored = dict(
                    con.execute("SELECT run_id, count(*) FROM completions GROUP BY run_id").fetchall()
                )
                con.close()
            finally:
                again.terminate()
                again.wait(30)
            missing = sorted(received - stored.keys())
            twice = sorted(k for k, n in stored.items() if n > 1)
            print(
                f"kill9 run {run}: {SECONDS:g} s x {CONCURRENCY} clients: received {len(received)}, "
                f"cut by the kill {failed}, stored {len(stored)}, missing {len(missing)}, "
                f"duplicated {len(twice)}"
            )
            assert len(received) > 20, "the load did not run"
            assert not missing, f"{len(missing)} received responses not stored, e.g. {missing[:5]}"
            assert not twice, f"stored twice: {twice[:5]}"
    finally:
        stub.kill()
        stub.wait(10)
