"""Proxies x1 vs x2 on one PostgreSQL: throughput, rows stored, and seq still gapless under contention.

One run: a throwaway PostgreSQL (tests/pg.py, the `pgserver` wheel's binaries), the stub upstream
(tests/stub_upstream.py), then for N = 1 and 2 a fresh database and N `rlproxy serve --no-train`
replicas attached to the stub, loaded by N `wrk` processes (one per replica, the connections split
between them). Every request carries one of 64 run ids shared by all replicas, so the replicas'
writers number the same runs at once: the worst case for the per-run counter (`runs.next_seq`).

Printed per case: requests/s (sum over replicas), 2xx, rows stored vs 2xx answered, and whether every
run's seq is 0..n-1 exactly once; then the ratio x2 / x1. On a machine where the proxies and the
load generator share few cores, x2 cannot reach 2: the ratio says how much of the second replica's
CPU turns into throughput, and the rows/seq columns that correctness holds while it does.

    python bench/replicas.py            # 10 s per case, stub delay 50 ms, 64 connections
    python bench/replicas.py --quick    # 3 s per case
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from pg import PostgresServer, bindir  # noqa: E402
from proxy import free_port, wait_http  # noqa: E402

VENV_BIN = Path(sys.executable).parent
RUNS = 64

LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local delay = os.getenv("BENCH_DELAY")
if delay and delay ~= "" then wrk.headers["x-stub-delay"] = delay end
wrk.body = '{"model":"stub-model","messages":[{"role":"user","content":"Find the weather in Paris."}],'
  .. '"max_tokens":8}'
local n = math.random(0, 1000000)
request = function()
  n = n + 1
  wrk.headers["X-Run-Id"] = "bench-" .. (n % RUNS)
  return wrk.format(nil)
end
done = function(summary, latency, requests)
  io.write(string.format("RESULT %d %d %d %d\n", summary.requests, summary.duration,
    summary.errors.status, summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.timeout))
end
""".replace("RUNS", str(RUNS))


async def _pg(url: str, sql: str) -> list:
    import asyncpg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    conn = await asyncpg.connect(host=u.host, port=u.port, user=u.username, database=u.database)
    try:
        return await conn.fetch(sql)
    finally:
        await conn.close()


def _wrk(url: str, script: Path, conns: int, seconds: float, delay: float) -> subprocess.Popen:
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "10s", "-s", str(script), url]
    env = {**os.environ, "BENCH_DELAY": str(delay)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _result(proc: subprocess.Popen) -> tuple[int, float, int]:
    out = proc.communicate(timeout=600)[0]
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    n, dur, non2xx, sockerr = (int(x) for x in line.split()[1:])
    return n - non2xx - sockerr, n / (dur / 1e6), non2xx + sockerr


def case(n: int, pg: str, stub: str, tmp: Path, args: argparse.Namespace) -> dict:
    """N replicas on a fresh database under one load; what they answered and what they stored."""
    name = f"bench_{n}_{uuid.uuid4().hex[:6]}"
    asyncio.run(_pg(pg, f'CREATE DATABASE "{name}"'))
    db = pg.rsplit("/", 1)[0] + f"/{name}"
    procs = []
    try:
        urls = []
        for i in range(n):
            port = free_port()
            env = {**os.environ, "RLPROXY_CACHE_DIR": str(tmp / f"cache-{n}-{i}")}
            cmd = [str(VENV_BIN / "rlproxy"), "serve", "--backend", "vllm", "--upstream", stub]
            cmd += ["--model", "stub-model", "--no-train", "--db", db, "--port", str(port)]
            cmd += ["--no-access-log", "--log-level", "warning"]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_http(f"{u}/healthz", 120)
        script = tmp / "replicas.lua"
        script.write_text(LUA)
        _result(_wrk(f"{urls[0]}/v1/chat/completions", script, 8, 1, args.delay))  # warm up
        asyncio.run(_pg(db, "TRUNCATE runs, completions CASCADE"))
        loads = [
            _wrk(f"{u}/v1/chat/completions", script, args.conns // n, args.seconds, args.delay) for u in urls
        ]
        results = [_result(p) for p in loads]
        ok = sum(r[0] for r in results)
        rows = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the writers commit within their flush interval
            rows = asyncio.run(_pg(db, "SELECT count(*) AS n FROM completions"))[0]["n"]
            if rows >= ok:
                break
            time.sleep(0.2)
        seq = asyncio.run(
            _pg(
                db,
                "SELECT count(*) AS bad FROM (SELECT run_id FROM completions GROUP BY run_id "
                "HAVING count(DISTINCT seq) <> count(*) OR max(seq) + 1 <> count(*) OR min(seq) <> 0) x",
            )
        )[0]["bad"]
        rps, errors = sum(r[1] for r in results), sum(r[2] for r in results)
        return {"replicas": n, "rps": rps, "ok": ok, "errors": errors, "rows": rows, "seq_bad_runs": seq}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 s per case")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--delay", type=float, default=0.05, help="stub seconds per answer (a model's pace)")
    ap.add_argument("--conns", type=int, default=64, help="connections in all, split over the replicas")
    args = ap.parse_args()
    if args.quick:
        args.seconds = 3.0
    binaries = bindir()
    if binaries is None:
        print("no PostgreSQL: pip install -e '.[dev]' (pgserver)")
        return 1
    server = PostgresServer.start(binaries)
    stub_port = free_port()
    stub = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "stub_upstream.py"), "--port", str(stub_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        stub_url = f"http://127.0.0.1:{stub_port}"
        wait_http(f"{stub_url}/health", 30)
        with tempfile.TemporaryDirectory(prefix="rlproxy-bench-") as tmp:
            print(f"stub delay {args.delay * 1000:.0f} ms, {args.conns} connections, {RUNS} shared run ids, "
                  f"{args.seconds:g} s per case, {os.cpu_count()} CPUs")  # fmt: skip
            out = [case(n, server.url, stub_url, Path(tmp), args) for n in (1, 2)]
        print(
            f"{'proxies':>7} {'req/s':>8} {'2xx':>7} {'errors':>6} {'rows':>7} {'rows/2xx':>8} {'seq bad':>7}"
        )
        for r in out:
            print(f"{r['replicas']:>7} {r['rps']:>8.0f} {r['ok']:>7} {r['errors']:>6} {r['rows']:>7} "
                  f"{r['rows'] / max(1, r['ok']):>8.3f} {r['seq_bad_runs']:>7}")  # fmt: skip
        print(f"x2 / x1 throughput: {out[1]['rps'] / max(1e-9, out[0]['rps']):.2f}")
        bad = any(r["rows"] < r["ok"] or r["seq_bad_runs"] for r in out)
        return 1 if bad else 0
    finally:
        stub.kill()
        stub.wait(10)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
