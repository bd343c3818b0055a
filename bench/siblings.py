"""What siblings cost (issue 54): one prefill for K answers, and the app's latency with siblings on.

    python bench/siblings.py [--quick] [--model smollm2-135m] [--k 4] [--rounds 2] [--seconds 60]

1. **K answers, one request vs K requests.** The embedded engine in this process, one stored prompt
   (a chat prompt's exact ids from `/tokenize`): `/v1/completions` with `n = K` against K separate
   requests sent at once (the engine prefills identical prompts of one admission once, too) and
   one after another (each prefilled again: the prefix cache is off here), alternating, every
   answer exactly `max_tokens` long (EOS ignored). Figures: sampled tokens per CPU-second of this
   process (the engine's worker runs here) and per wall second, and the ratio n=K / K requests.
2. **The app's latency with siblings on vs off.** `rlproxy serve` (embedded engine, trainer off) is
   started with `siblings=off`, then with `siblings=new` (`siblings_k`, `scorer=checks`), alternating
   `--rounds` times; each time W workers play tagged two-turn episodes (a turn, its answer in the
   next prompt, a second turn, then the reward) for `--seconds`. Figures per arm: the app requests'
   p50 and p90 latency, episodes, and the sibling answers the proxy sampled meanwhile (from
   `/metrics`). The goal: p50 with siblings on within 10% of off.

Run it alone on a quiet box (`uptime` is printed first); the ratios compare arms of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from proxy import free_port, wait_http  # noqa: E402

from rlproxy.inference.embedded import EmbeddedBackend  # noqa: E402

VENV_BIN = Path(sys.executable).parent
TASK = "Pick a number between 1 and 100 and say why you picked it, in one sentence."


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, ids: list[int], n: int, mt: int, seed: int
) -> int:
    body = {
        "model": model,
        "prompt": ids,
        "n": n,
        "max_tokens": mt,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    r = await client.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return sum(len(c["token_ids"]) for c in r.json()["choices"])


async def prefill_share(model: str, k: int, max_tokens: int, repeats: int, threads: int | None) -> None:
    backend = EmbeddedBackend(model, threads=threads, max_batch=16, prefix_cache_bytes=0)
    await backend.start()
    me = psutil.Process()
    try:
        async with httpx.AsyncClient() as client:
            url, served = backend.base_url, backend.served_model
            r = await client.post(
                f"{url}/tokenize", json={"model": served, "messages": [{"role": "user", "content": TASK * 4}]}
            )
            ids = r.json()["tokens"]
            await one_request(client, url, served, ids, 1, 4, 0)  # warm up
            names = ("n=K", "K requests at once", "K requests one by one")
            arms: dict[str, list[tuple[int, float, float]]] = {a: [] for a in names}
            for rep in range(repeats):
                for arm in names if rep % 2 == 0 else names[::-1]:
                    cpu0, t0 = sum(me.cpu_times()[:2]), time.perf_counter()
                    seeds = [rep * 100 + i for i in range(k)]
                    if arm == "n=K":
                        tokens = await one_request(client, url, served, ids, k, max_tokens, rep)
                    elif arm == "K requests at once":
                        one = [one_request(client, url, served, ids, 1, max_tokens, s) for s in seeds]
                        tokens = sum(await asyncio.gather(*one))
                    else:
                        tokens = 0
                        for s in seeds:
                            tokens += await one_request(client, url, served, ids, 1, max_tokens, s)
                    arms[arm].append((tokens, sum(me.cpu_times()[:2]) - cpu0, time.perf_counter() - t0))
    finally:
        await backend.stop()
    print(f"\n## 1. {k} answers to one {len(ids)}-token prompt, {max_tokens} tokens each, {repeats} repeats")
    print("| arm | tokens per CPU-second | tokens per wall second |")
    print("|---|---|---|")
    rates = {}
    for arm, rows in arms.items():
        tok = sum(r[0] for r in rows)
        cpu = sum(r[1] for r in rows)
        wall = sum(r[2] for r in rows)
        rates[arm] = (tok / cpu, tok / wall)
        print(f"| {arm} | {tok / cpu:.1f} | {tok / wall:.1f} |")
    for other in list(arms)[1:]:
        print(
            f"ratio n=K / {other}: {rates['n=K'][0] / rates[other][0]:.2f}x per CPU-second, "
            f"{rates['n=K'][1] / rates[other][1]:.2f}x per wall second"
        )


class Serve:
    """`rlproxy serve` with the embedded engine, trainer off, in its own process."""

    def __init__(self, model: str, tmp: Path, siblings: str, k: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        db = tmp / f"{siblings}-{uuid.uuid4().hex[:6]}.db"
        env = {
            **os.environ,
            "RLPROXY_MODEL": model,
            "RLPROXY_TRAIN": "false",
            "RLPROXY_DB_URL": f"sqlite+aiosqlite:///{db}",
            "RLPROXY_SIBLINGS": siblings,
            "RLPROXY_SIBLINGS_K": str(k),
            "RLPROXY_SCORER": "checks",
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
        self.log = open(db.with_suffix(".log"), "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp)
        wait_http(f"{self.url}/healthz", timeout=300)

    def siblings_sampled(self) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        m = re.search(r"^rlproxy_siblings_sampled_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def episodes(
    url: str, model: str, workers: int, seconds: float, max_tokens: int
) -> tuple[list[float], int]:
    """Two-turn tagged episodes with a reward, `workers` at once; the app requests' latencies (s)."""
    lat: list[float] = []
    done = 0
    end = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            while time.perf_counter() < end:
                run = f"bench-{uuid.uuid4().hex}"
                msgs = [
                    {
                        "role": "user",
                        "content": f"Pick a number between 1 and {10 + w}. Reply with digits only.",
                    }
                ]
                for _turn in range(2):
                    t0 = time.perf_counter()
                    r = await c.post(
                        "/v1/chat/completions",
                        json={"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 1.0},
                        headers={"X-Run-Id": run},
                    )
                    lat.append(time.perf_counter() - t0)
                    r.raise_for_status()
                    msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "Add one to it."}]
                (await c.post(f"/v1/runs/{run}/reward", json={"reward": 0.5})).raise_for_status()
                done += 1

    await asyncio.gather(*(worker(w) for w in range(workers)))
    return lat, done


def latency(model: str, k: int, rounds: int, seconds: float, workers: int, max_tokens: int) -> None:
    results: dict[str, list] = {"off": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(rounds):
            for arm in ("off", "new") if rnd % 2 == 0 else ("new", "off"):
                s = Serve(model, Path(tmp), arm, k)
                try:
                    asyncio.run(episodes(s.url, model, 1, 5, max_tokens))  # warm up
                    before = s.siblings_sampled()
                    lat, eps = asyncio.run(episodes(s.url, model, workers, seconds, max_tokens))
                    results[arm].append((lat, eps, s.siblings_sampled() - before))
                finally:
                    s.stop()
    print(
        f"\n## 2. app latency, {workers} workers of two-turn episodes, "
        f"{seconds:.0f} s x {rounds} rounds per arm"
    )
    print("| siblings | app p50 ms | app p90 ms | episodes | sibling answers sampled |")
    print("|---|---|---|---|---|")
    p50 = {}
    for arm, rows in results.items():
        lat = [x for r in rows for x in r[0]]
        p50[arm] = statistics.median(lat)
        p90 = statistics.quantiles(lat, n=10)[-1]
        print(
            f"| {arm} | {p50[arm] * 1e3:.0f} | {p90 * 1e3:.0f} | {sum(r[1] for r in rows)} "
            f"| {sum(r[2] for r in rows):.0f} |"
        )
    print(f"p50 on / off: {p50['new'] / p50['off']:.3f} (goal <= 1.10)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, 30 s per arm")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=4, help="answers per sibling group")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", choices=["prefill", "latency"], default=None)
    a = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} uptime: {os.getloadavg()}")
    if a.only in (None, "prefill"):
        asyncio.run(prefill_share(a.model, a.k, a.max_tokens, 2 if a.quick else 6, a.threads))
    if a.only in (None, "latency"):
        latency(a.model, a.k, 1 if a.quick else a.rounds, 30 if a.quick else a.seconds, a.workers, 16)


if __name__ == "__main__":
    main()
