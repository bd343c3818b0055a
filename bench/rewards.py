"""What a reward costs the proxy, next to what a tagged completion costs it, in the same run.

An app posts one reward per run: one for every few completions. This measures both sides of that on
one `rlproxy serve` (attached to tests/stub_upstream.py, SQLite, writer process, as bench/proxy.py
runs it): N runs of one turn each are sent from `--workers` threads on keep-alive connections, then
one reward for each run from the same threads. For each phase it prints the serving and the writer
process's CPU per call, the rate and the latency, and the reward's CPU as a multiple of the
completion's (the baseline, measured in the same run: these machines are noisy).

    python bench/rewards.py              # 3,000 runs
    python bench/rewards.py --runs 1000 --workers 16
    python bench/rewards.py --runs 200 --workers 1 --think-ms 100   # an app scoring each episode first
    python bench/rewards.py --runs 1000 --workers 1 --episodes       # a turn, its reward at once, next

`--episodes` adds a third phase: each call is a run's turn and then its reward, as an app that waits
for each answer and scores it at once does (timed whole, next to the two phases above).
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy as bench  # noqa: E402  (bench/proxy.py: the stub, `serve` and its CPU counters)

BODY = {"model": "stub-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def phase(px: bench.Proxy, workers: int, n: int, call, think: float = 0.0) -> dict:
    """Run `call(client, i)` for i < n from `workers` threads, each `think` seconds after the one
    before (not timed); serve's CPU per call, rate, latency."""
    local = threading.local()

    def one(i: int) -> float:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=px.url, timeout=60)
        if think:
            time.sleep(think)
        started = time.perf_counter()
        call(client, i)
        return time.perf_counter() - started

    serving, writer, started = px.serving_cpu(), px.writer_cpu(), time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        latencies = sorted(pool.map(one, range(n)))
    elapsed = time.perf_counter() - started
    return {
        "serving_us": 1e6 * (px.serving_cpu() - serving) / n,
        "writer_us": 1e6 * (px.writer_cpu() - writer) / n,
        "rate": n / elapsed,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[int(0.99 * (n - 1))],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=48)
    ap.add_argument("--think-ms", type=float, default=0.0, help="a pause before each reward (scoring)")
    ap.add_argument("--episodes", action="store_true", help="also: a turn and its reward, run by run")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rlproxy-bench-rewards-"))
    port = bench.free_port()
    stub = subprocess.Popen(
        [sys.executable, str(bench.ROOT / "tests" / "stub_upstream.py"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    px = None
    try:
        bench.wait_http(f"http://127.0.0.1:{port}/v1/models")
        px = bench.Proxy(f"http://127.0.0.1:{port}/v1", tmp / "store.db")

        def turn(client: httpx.Client, i: int) -> None:
            resp = client.post("/v1/chat/completions", json=BODY, headers={"X-Run-Id": f"run-{i}"})
            assert resp.status_code == 200, resp.text

        def reward(client: httpx.Client, i: int) -> None:
            resp = client.post(f"/v1/runs/run-{i}/reward", json={"reward": 1.0, "metrics": {"ok": 1.0}})
            assert resp.status_code == 200, resp.text

        chat = phase(px, args.workers, args.runs, turn)
        time.sleep(1.0)  # the last turns committed: the rewards find every run
        rewards = phase(px, args.workers, args.runs, reward, args.think_ms / 1000)
        results = [("tagged completion", chat), ("reward", rewards)]
        if args.episodes:

            def episode(client: httpx.Client, i: int) -> None:
                turn(client, args.runs + i)
                reward(client, args.runs + i)

            results.append(("turn + its reward", phase(px, args.workers, args.runs, episode)))
        print(
            f"# bench/rewards.py: {args.runs} runs, {args.workers} threads, {args.think_ms:g} ms before"
            f" each reward; {bench.machine()}"
        )
        for name, r in results:
            print(
                f"  {name:18}: serving {r['serving_us']:6.0f} us, writer {r['writer_us']:5.0f} us of CPU "
                f"each; {r['rate']:5.0f}/s, p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms"
            )
        print(f"  reward / completion, serving CPU: {rewards['serving_us'] / chat['serving_us']:.2f}x")
        runs = args.runs * (2 if args.episodes else 1)
        stored = bench.rows_for(tmp / "store.db", "run", runs, prefix=True)
        con = sqlite3.connect(f"file:{tmp / 'store.db'}?mode=ro", uri=True, timeout=10)
        try:
            rewarded = con.execute("SELECT count(*) FROM runs WHERE reward = 1.0").fetchone()[0]
        finally:
            con.close()
        ok = stored == rewarded == runs
        verdict = "ok" if ok else "MISSED"
        print(f"  completions stored {stored}, runs rewarded {rewarded}, of {runs}: {verdict}")
        return 0 if ok else 1
    finally:
        if px is not None:
            px.stop()
        stub.terminate()


if __name__ == "__main__":
    sys.exit(main())
