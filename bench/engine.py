"""Embedded engine throughput and memory on smollm2-135m, against baselines from the same run.

    python bench/engine.py [--quick] [--threads N] [--max-tokens N] [--no-rss]

Measures completion tokens/s of (1) plain `model.generate`, batch 1, one prompt after another;
(2) the engine over HTTP, 8 requests one after another; (3) the engine over HTTP, 8 requests at
once. Every run generates exactly `max_tokens` per request (EOS ignored) so the counts are equal.
Then the peak RSS of `run_engine` (what `rlproxy engine` runs) in a child process while it serves
8 concurrent requests. Goals from issue 2: (3)/(2) >= 3x, peak RSS <= 1.5 GB.

    python bench/engine.py --directory [--groups N] [--threads N] [--kv]

Issue 21: sampling a `directory` group (the demo's real agent loop, `rlproxy.demo.directory`:
8 episodes at once, 3-5 calls each, every call's prompt extending the last with the reply and a
tool result) with the prefix cache off vs on, on two engines side by side, alternating groups with
the same seeds. Both engines must produce the same replies (the cache changes no output); figures
are wall time per group, prompt positions prefilled and the cache's hit rate. Goal: >= 1.6x.
`--kv`: both engines keep the prefix cache and differ in the decode cache only: transformers'
DynamicCache (concatenates, copying the whole KV every token) vs the engine's kvbatch.GrowingLayer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlproxy.inference.embedded import EmbeddedBackend  # noqa: E402
from rlproxy.inference.models import resolve_model  # noqa: E402

MODEL = "smollm2-135m"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash map is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a compiler do?",
    "Name a famous painting and its painter.",
]


def bench_generate(path: str, max_tokens: int, threads: int) -> float:
    """Plain transformers: `model.generate`, batch 1, prompts one after another; tokens/s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def one(prompt: str) -> int:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **ids,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=True,
                temperature=0.7,
                pad_token_id=tok.pad_token_id or tok.eos_token_id,
            )
        return out.shape[1] - ids["input_ids"].shape[1]

    one(PROMPTS[0])  # warm up
    start = time.perf_counter()
    tokens = sum(one(p) for p in PROMPTS)
    return tokens / (time.perf_counter() - start)


async def _request(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> int:
    r = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.7,
        extra_body={"ignore_eos": True},
    )
    return r.usage.completion_tokens


async def bench_engine(max_tokens: int, threads: int, repeats: int) -> tuple[float, float, int]:
    """The engine over HTTP: (sequential tokens/s, concurrent tokens/s, largest batch seen)."""
    backend = EmbeddedBackend(MODEL, threads=threads, max_batch=16)
    await backend.start()
    try:
        client = openai.AsyncOpenAI(
            base_url=f"{backend.base_url}/v1", api_key="unused", max_retries=0, timeout=600
        )
        model = backend.served_model
        await _request(client, model, PROMPTS[0], 8)  # warm up
        assert backend.engine is not None
        backend.engine.stats["max_rows"] = 0
        sequential = concurrent = 0.0
        # alternate the two modes and keep each one's best, so drifting background load on a
        # shared machine does not land on one side of the ratio only
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = 0
            for p in PROMPTS:
                tokens += await _request(client, model, p, max_tokens)
            sequential = max(sequential, tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            counts = await asyncio.gather(*(_request(client, model, p, max_tokens) for p in PROMPTS))
            concurrent = max(concurrent, sum(counts) / (time.perf_counter() - start))
        return sequential, concurrent, backend.engine.stats["max_rows"]
    finally:
        await backend.stop()


def peak_rss_while_serving(max_tokens: int, threads: int) -> float:
    """Peak RSS (GB) of `run_engine` in a child process, from start through 8 concurrent requests."""
    port = _free_port()
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING);"
        "import uvicorn; from rlproxy.inference.embedded import run_engine;"
        f"run_engine({MODEL!r}, lambda app: uvicorn.Config(app, host='127.0.0.1', port={port}),"
        f" threads={threads})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ps = psutil.Process(proc.pid)
    peak = 0
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            peak = max(peak, ps.memory_info().rss)
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("run_engine did not become healthy in 300 s")

        async def load() -> None:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
            await asyncio.gather(*(_request(client, MODEL, p, max_tokens) for p in PROMPTS))

        async def watch(task: asyncio.Task) -> None:
            nonlocal peak
            while not task.done():
                peak = max(peak, ps.memory_info().rss)
                await asyncio.sleep(0.02)

        async def both() -> None:
            task = asyncio.create_task(load())
            await watch(task)
            await task

        asyncio.run(both())
        return peak / 1e9
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_directory(groups: int, threads: int, cache_bytes: int, kv: bool = False) -> dict[str, float]:
    """Sample `groups` directory groups on a cache-off and a cache-on engine, alternating.

    kv: both engines keep the prefix cache; "off" decodes with transformers' DynamicCache (a copy of
    the whole KV per token), "on" with the engine's own (kvbatch.GrowingLayer, written in place)."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import DynamicCache

    from rlproxy.demo.directory import DIRECTORY, play_episode
    from rlproxy.inference import kvbatch

    torch.set_num_threads(threads)
    caches = {"off": DynamicCache if kv else kvbatch.new_cache, "on": kvbatch.new_cache}

    async def start(size: int) -> EmbeddedBackend:
        backend = EmbeddedBackend(MODEL, threads=threads, max_batch=16, prefix_cache_bytes=size)
        await backend.start()
        return backend

    loop = asyncio.new_event_loop()
    off_bytes = cache_bytes if kv else 0
    backends = {
        "off": loop.run_until_complete(start(off_bytes)),
        "on": loop.run_until_complete(start(cache_bytes)),
    }
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    seconds = {"off": 0.0, "on": 0.0}
    cpu = {"off": 0.0, "on": 0.0}  # process CPU-s while one mode's group runs (the other is idle)
    replies: dict[str, list] = {"off": [], "on": []}
    calls = 0
    try:

        def group(mode: str, seed: int) -> list:
            backend = backends[mode]
            client = openai.OpenAI(base_url=f"{backend.base_url}/v1", api_key="x", max_retries=0, timeout=900)
            people = tuple(random.Random(seed).sample(sorted(DIRECTORY), 2))
            with ThreadPoolExecutor(8) as pool:
                return list(
                    pool.map(
                        lambda i: play_episode(
                            client, backend.served_model, "bench", people, seed=seed * 100 + i
                        ),
                        range(8),
                    )
                )

        for mode in ("off", "on"):  # warm up: one call each
            group_client = openai.OpenAI(base_url=f"{backends[mode].base_url}/v1", api_key="x", max_retries=0)
            _ = group_client.chat.completions.create(
                model=backends[mode].served_model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            engine = backends[mode].engine
            assert engine is not None
            engine.stats.update(prefill_tokens=0, prompt_tokens=0)
        for g in range(groups):
            order = ("off", "on") if g % 2 == 0 else ("on", "off")  # drifting load hits both sides
            for mode in order:
                kvbatch.new_cache = caches[mode]  # one engine decodes at a time
                start_t, start_cpu = time.perf_counter(), time.process_time()
                episodes = group(mode, 1000 + g)
                seconds[mode] += time.perf_counter() - start_t
                cpu[mode] += time.process_time() - start_cpu
                replies[mode].append([e.replies for e in episodes])
                if mode == "on":
                    calls += sum(e.calls for e in episodes)
            print(f"  group {g + 1}: {sum(len(r) for r in replies['on'][-1])} calls", flush=True)
        stats = {m: dict(backends[m].engine.stats) for m in backends}  # type: ignore[union-attr]
        cache = backends["on"].engine.prefix_cache  # type: ignore[union-attr]
        return {
            "groups": groups,
            "calls": calls,
            "same_replies": float(replies["off"] == replies["on"]),
            "off_s": seconds["off"] / groups,
            "on_s": seconds["on"] / groups,
            "off_cpu": cpu["off"] / groups,
            "on_cpu": cpu["on"] / groups,
            "off_prefill": stats["off"]["prefill_tokens"] / groups,
            "on_prefill": stats["on"]["prefill_tokens"] / groups,
            "prompt": stats["on"]["prompt_tokens"] / groups,
            "hit_rate": cache.stats["hits"] / max(1, cache.stats["lookups"]),
            "reused": cache.stats["tokens_reused"] / max(1, cache.stats["tokens_looked_up"]),
            "cache_mb": cache.bytes / 2**20,
        }
    finally:
        for backend in backends.values():
            asyncio.run_coroutine_threadsafe(backend.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 tokens per request instead of 128")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request")
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (engine and baseline)"
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="alternating rounds (best kept); 1 quick, 2 full"
    )
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS measurement")
    ap.add_argument("--directory", action="store_true", help="directory groups, prefix cache off vs on")
    ap.add_argument("--groups", type=int, default=3, help="--directory: groups per mode")
    ap.add_argument(
        "--kv",
        action="store_true",
        help="--directory: both keep the prefix cache; DynamicCache (off) vs the engine's own (on)",
    )
    ap.add_argument(
        "--cache-bytes", type=int, default=512 * 2**20, help="--directory: prefix cache of the 'on' engine"
    )
    args = ap.parse_args()
    if args.directory:
        what = "decode cache: 'off' DynamicCache, 'on' GrowingLayer" if args.kv else "prefix cache off vs on"
        print(
            f"model {MODEL}: directory groups (8 episodes each), torch threads {args.threads}; {what}",
            flush=True,
        )
        r = bench_directory(args.groups, args.threads, args.cache_bytes, args.kv)
        print(
            f"groups per mode                     : {r['groups']:8d}   ({r['calls']} calls with the cache on)"
        )
        print(f"same replies, cache off and on      : {'yes' if r['same_replies'] else 'NO'}")
        print(f"prompt positions per group          : {r['prompt']:8.0f}")
        print(
            f"prefilled per group, cache off      : {r['off_prefill']:8.0f}   (twins of one admission once)"
        )
        print(f"prefilled per group, cache on       : {r['on_prefill']:8.0f}")
        print(
            f"prefix cache hit rate (lookups)     : {r['hit_rate']:8.2f}   "
            f"({r['reused']:.2f} of prompt tokens reused)"
        )
        print(f"prefix cache held at the end        : {r['cache_mb']:8.1f} MiB")
        print(f"seconds per group, cache off        : {r['off_s']:8.1f}")
        print(f"seconds per group, cache on         : {r['on_s']:8.1f}")
        print(f"CPU-s per group, cache off / on     : {r['off_cpu']:8.1f} / {r['on_cpu']:.1f}")
        goal = "" if args.kv else "   (goal >= 1.6x)"
        print(f"ratio off / on                      : {r['off_s'] / r['on_s']:8.2f}x{goal}")
        return
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 2)
    path = resolve_model(MODEL)
    print(
        f"model {MODEL} ({path}), {len(PROMPTS)} requests x {max_tokens} tokens, torch threads {args.threads}"
    )

    gen = bench_generate(path, max_tokens, args.threads)
    print(f"model.generate, batch 1, one by one : {gen:8.1f} tok/s")
    seq, conc, rows = asyncio.run(bench_engine(max_tokens, args.threads, args.repeats))
    print(f"engine over HTTP, one after another : {seq:8.1f} tok/s")
    print(f"engine over HTTP, 8 concurrent      : {conc:8.1f} tok/s   (largest batch {rows} rows)")
    print(f"ratio concurrent / one-by-one       : {conc / seq:8.2f}x   (goal >= 3x)")
    print(f"ratio concurrent / model.generate   : {conc / gen:8.2f}x")
    print(f"ratio one-by-one / model.generate   : {seq / gen:8.2f}x")
    if not args.no_rss:
        rss = peak_rss_while_serving(max_tokens, args.threads)
        print(f"peak RSS of run_engine while serving: {rss:8.2f} GB   (goal <= 1.5 GB)")


if __name__ == "__main__":
    main()
