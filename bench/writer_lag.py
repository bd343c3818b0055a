"""How long the writer holds the serving loop: event-loop lag while records and rewards flow.

One process, no HTTP: a Writer on a fresh SQLite file (migrated, WAL), fed like the proxy feeds it
under tagged traffic (a record every `--every-ms`, a run per 4 records, a reward for every other
run, each awaited in its own task), while a 1 ms timer samples the loop's lag. Prints the lag's
p50/p99/max and the serving thread's CPU per 1,000 records, for the writer on its own thread (the
default) and on the serving loop (`thread=False`, what it was before), in the same run.

    .venv/bin/python bench/writer_lag.py [--seconds 5] [--every-ms 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlproxy.storage.db import create_engine, upgrade  # noqa: E402
from rlproxy.storage.records import CompletionRecord, Endpoint  # noqa: E402
from rlproxy.storage.writer import Writer  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Find the weather in Paris and answer in one word."},
]


def record(run_id: str) -> CompletionRecord:
    return CompletionRecord(
        run_id=run_id,
        default_group="g",
        policy="stub-model",
        adapter="stub-model",
        policy_step=0,
        endpoint=Endpoint.CHAT,
        stream=False,
        request={"model": "stub-model", "messages": MESSAGES, "max_tokens": 8},
        response={
            "id": "x",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "sunny " * 8}}],
        },
        prompt_token_ids=list(range(40)),
        token_ids=[list(range(8))],
        logprobs=[[-0.5] * 8],
        finish_reason="length",
        status="ok",
        status_code=200,
        prompt_tokens=40,
        completion_tokens=8,
    )


async def one(url: str, threaded: bool, seconds: float, every: float) -> dict:
    engine = create_engine(url)
    w = Writer(engine, thread=threaded)
    await w.start()
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    stop = False

    async def sample() -> None:
        while not stop:
            due = loop.time() + 0.001
            await asyncio.sleep(0.001)
            lags.append(max(0.0, loop.time() - due))

    rewards: list[asyncio.Task] = []
    sampler = asyncio.create_task(sample())
    cpu0, t_end, n = time.thread_time(), loop.time() + seconds, 0
    prefix = f"{'t' if threaded else 'l'}{time.monotonic_ns()}"
    while loop.time() < t_end:
        run = f"{prefix}-{n // 4}"
        w.submit(record(run))
        n += 1
        if n % 8 == 4:  # the run's 4th record: reward every other run
            rewards.append(asyncio.create_task(w.reward(run, 0.5, timeout=30)))
        await asyncio.sleep(every)
    await asyncio.gather(*rewards)
    stop = True
    await sampler
    cpu = time.thread_time() - cpu0
    await w.close()
    await engine.dispose()
    lags.sort()
    return {
        "records": n,
        "rewards": len(rewards),
        "p50": statistics.median(lags) * 1000,
        "p99": lags[int(0.99 * (len(lags) - 1))] * 1000,
        "max": lags[-1] * 1000,
        "cpu_k": cpu / n * 1000,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--every-ms", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--switch-ms", type=float, default=None, help="sys.setswitchinterval, ms (default: Python's)"
    )
    args = ap.parse_args()
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1000)
    tmp = Path(tempfile.mkdtemp(prefix="rlproxy-wlag-"))
    url = f"sqlite+aiosqlite:///{tmp / 'w.db'}"
    upgrade(url)
    for r in range(args.rounds):
        for threaded in (False, True):
            res = asyncio.run(one(url, threaded, args.seconds, args.every_ms / 1000))
            where = "own thread " if threaded else "serving loop"
            print(
                f"round {r} writer on {where}: {res['records']} records, {res['rewards']} rewards;"
                f" loop lag p50 {res['p50']:.3f} ms, p99 {res['p99']:.3f} ms, max {res['max']:.1f} ms;"
                f" serving thread CPU {res['cpu_k']:.3f} s per 1,000 records"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
