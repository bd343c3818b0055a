"""What the proxy costs: added latency, throughput ratio, CPU per request, rows stored.

One run, three processes: a plain-asyncio stub upstream (bench/stub_upstream.py), the proxy
(`rlproxy serve` attached to the stub, capture on, SQLite, no trainer, no access log) and `wrk`
(Debian package `wrk`) with a small Lua script as the load generator — a Python client saturates
near 600 req/s and would hide the proxy's cost. Every case runs against the stub directly and
through the proxy in the same run, so the printed ratios compare like with like.

    1. delay 0, concurrency 1, non-streaming: latency added by the proxy at p50 and p99
       (goal p50 <= 1 ms, p99 <= 5 ms).
    2. delay 50 ms (a model's pace), concurrency 64, non-streaming and streaming:
       throughput via proxy / direct (goal >= 0.9).
    3. CPU seconds of the proxy process per 1,000 requests (its own figure, to track).
    4. rows stored == requests the proxy forwarded, in every case.

    python bench/proxy.py            # 10 s per measurement
    python bench/proxy.py --quick    # 3 s per measurement
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local run_id = os.getenv("BENCH_RUN_ID")
if run_id and run_id ~= "" then wrk.headers["X-Run-Id"] = run_id end
wrk.headers["x-stub-delay"] = os.getenv("BENCH_DELAY") or "0"
local stream = os.getenv("BENCH_STREAM") == "1"
wrk.body = '{"model":"stub-model","messages":[{"role":"system","content":"You are a helpful agent."},'
  .. '{"role":"user","content":"Find the weather in Paris and answer in one word."}],'
  .. '"max_tokens":8,"temperature":0.7' .. (stream and ',"stream":true' or '') .. '}'
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %d %.1f %.1f %.1f\n", summary.requests, summary.duration,
    e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def wrk(url: str, script: Path, conns: int, seconds: float, run_id: str, delay: float, stream: bool) -> dict:
    """Run wrk; its Lua `done` prints: requests, duration us, non-2xx, socket errors, p50, p99, mean (us)."""
    env = {
        **os.environ,
        "BENCH_RUN_ID": run_id,
        "BENCH_DELAY": str(delay),
        "BENCH_STREAM": "1" if stream else "0",
    }
    threads = 1 if conns == 1 else 2
    cmd = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "10s", "-s", str(script), url]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    n, dur, non2xx, sockerr, p50, p99, mean = line.split()[1:]
    return {
        "requests": int(n),
        "rps": int(n) / (int(dur) / 1e6),
        "non2xx": int(non2xx),
        "socket_errors": int(sockerr),
        "p50_ms": float(p50) / 1000,
        "p99_ms": float(p99) / 1000,
        "mean_ms": float(mean) / 1000,
    }


def combine(results: list[dict]) -> dict:
    """Rounds of one side: summed requests and rate, median of each round's percentiles."""
    import statistics

    return {
        "requests": sum(r["requests"] for r in results),
        "rps": sum(r["rps"] for r in results) / len(results),
        "non2xx": sum(r["non2xx"] for r in results),
        "socket_errors": sum(r["socket_errors"] for r in results),
        "p50_ms": statistics.median(r["p50_ms"] for r in results),
        "p99_ms": statistics.median(r["p99_ms"] for r in results),
    }


def stub_count(stub_url: str) -> int:
    return httpx.get(f"{stub_url}/stub/stats").json()["requests"]


def rows_for(db_path: Path, run_id: str, expect: int, wait_s: float = 15.0) -> int:
    """Completions stored for `run_id`, once the writer has caught up with `expect` (or wait_s passed)."""
    deadline = time.monotonic() + wait_s
    n = -1
    while time.monotonic() < deadline:
        con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
        try:
            n = con.execute("SELECT count(*) FROM completions WHERE run_id = ?", (run_id,)).fetchone()[0]
        finally:
            con.close()
        if n >= expect:
            break
        time.sleep(0.2)
    return n


class Proxy:
    """`rlproxy serve` attached to the stub, in its own process (so its CPU time is its own)."""

    def __init__(self, stub_url: str, db_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "RLPROXY_MODEL": "stub-model",
            "RLPROXY_UPSTREAM": stub_url,
            "RLPROXY_BACKEND": "vllm",
            "RLPROXY_TRAIN": "false",
            "RLPROXY_DB_URL": f"sqlite+aiosqlite:///{db_path}",
        }
        cmd = [
            str(VENV_BIN / "rlproxy"),
            "serve",
            "--port",
            str(self.port),
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        wait_http(f"{self.url}/healthz")
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description="proxy overhead benchmark")
    ap.add_argument("--quick", action="store_true", help="3 s per measurement instead of 10")
    ap.add_argument("--seconds", type=float, default=None)
    args = ap.parse_args()
    secs = args.seconds or (3.0 if args.quick else 10.0)
    if shutil.which("wrk") is None:
        print("bench/proxy.py needs wrk: apt-get install -y wrk", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="rlproxy-bench-"))
    script = tmp / "post.lua"
    script.write_text(LUA)
    db_path = tmp / "bench.db"
    stub_port = free_port()
    stub_url = f"http://127.0.0.1:{stub_port}"
    stub = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "stub_upstream.py"), "--port", str(stub_port)],
        stdout=subprocess.DEVNULL,
    )
    proxy = None
    failures: list[str] = []
    try:
        wait_http(f"{stub_url}/health")
        proxy = Proxy(stub_url, db_path)
        direct, via = f"{stub_url}/v1/chat/completions", f"{proxy.url}/v1/chat/completions"
        # warm up both paths (connection pools, code paths, SQLite file)
        wrk(direct, script, 4, 1, "", 0, False)
        wrk(via, script, 4, 1, "warmup", 0, False)
        wrk(via, script, 4, 1, "warmup-s", 0, True)

        cases = [
            ("latency c=1 delay=0", 1, 0.0, False),
            ("throughput c=64 delay=50ms", 64, 0.05, False),
            ("throughput c=64 delay=50ms stream", 64, 0.05, True),
        ]
        rounds = 3 if args.quick else 5
        print(
            f"# bench/proxy.py: {secs:g} s per measurement in {rounds} alternating direct/proxy rounds,"
            " wrk, stub = plain asyncio, capture on (SQLite)"
        )
        total_req, total_cpu = 0, 0.0
        for i, (name, conns, delay, stream) in enumerate(cases):
            # alternate direct and proxy slices so that background load hits both alike
            run_id = f"bench-{i}"
            ds, ps = [], []
            forwarded, cpu = 0, 0.0
            for _ in range(rounds):
                ds.append(wrk(direct, script, conns, secs / rounds, "", delay, stream))
                before_stub, before_cpu = stub_count(stub_url), proxy.cpu()
                ps.append(wrk(via, script, conns, secs / rounds, run_id, delay, stream))
                forwarded += stub_count(stub_url) - before_stub
                cpu += proxy.cpu() - before_cpu
            d, p = combine(ds), combine(ps)
            rows = rows_for(db_path, run_id, forwarded)
            total_req += forwarded
            total_cpu += cpu
            print(f"\n## {name}")
            print(f"  direct : {d['rps']:8.0f} req/s  p50 {d['p50_ms']:.3f} ms  p99 {d['p99_ms']:.3f} ms")
            print(
                f"  proxy  : {p['rps']:8.0f} req/s  p50 {p['p50_ms']:.3f} ms  p99 {p['p99_ms']:.3f} ms"
                f"  (non-2xx {p['non2xx']}, socket errors {p['socket_errors']})"
            )
            if conns == 1:
                add50, add99 = p["p50_ms"] - d["p50_ms"], p["p99_ms"] - d["p99_ms"]
                ok = add50 <= 1.0 and add99 <= 5.0
                print(
                    f"  added latency: p50 {add50:.3f} ms (goal <= 1), p99 {add99:.3f} ms (goal <= 5)"
                    f"  {'OK' if ok else 'MISSED'}"
                )
                if not ok:
                    failures.append(name)
            else:
                ratio = p["rps"] / d["rps"]
                print(
                    f"  throughput proxy/direct: {ratio:.3f} (goal >= 0.9)"
                    f"  {'OK' if ratio >= 0.9 else 'MISSED'}"
                )
                if ratio < 0.9:
                    failures.append(name)
            per_k = cpu / max(forwarded, 1) * 1000
            print(f"  proxy CPU: {cpu:.2f} s for {forwarded} requests = {per_k:.3f} CPU-s per 1,000 requests")
            same = rows == forwarded and p["non2xx"] == 0
            print(
                f"  rows stored {rows} == requests forwarded {forwarded} (wrk completed {p['requests']}):"
                f" {'OK' if same else 'MISMATCH'}"
            )
            if not same:
                failures.append(name + " rows")
        print(f"\n## overall proxy CPU: {total_cpu / max(total_req, 1) * 1000:.3f} CPU-s per 1,000 requests")
        print("RESULT:", "all goals met" if not failures else "missed: " + ", ".join(failures))
        return 1 if failures else 0
    finally:
        if proxy is not None:
            proxy.stop()
        stub.terminate()
        stub.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
