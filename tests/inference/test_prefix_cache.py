"""Issue 21 item 6: the engine stops re-prefilling, and what it reuses changes no output.

The prefix cache's own bookkeeping is checked with exact numbers; the engine with the cache on is
checked against the engine with it off on multi-turn agent-shaped traffic (each call's prompt
extends the last prompt + completion), greedy and seeded, in concurrent batches that mix adapters,
`n` > 1 and rows of different lengths.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from rlproxy.inference.adapters import BASE_SLOT
from rlproxy.inference.engine import Engine, GenRequest
from rlproxy.inference.prefix_cache import PrefixCache
from rlproxy.inference.sampling import SamplingParams

# ---- the cache alone ------------------------------------------------------------------------


def _kv(n: int, layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer (H=1, L=n, D=2) keys and values whose value is the position (4 bytes each)."""
    k = [torch.arange(n, dtype=torch.float32).repeat(2, 1).T.unsqueeze(0) for _ in range(layers)]
    return k, [t.clone() for t in k]


def test_lookup_finds_the_longest_common_prefix_under_the_same_slot() -> None:
    cache = PrefixCache(10_000)
    cache.put("A", [1, 2, 3, 4, 5], *_kv(5))
    cache.put("A", [1, 2, 9], *_kv(3))
    cache.put("B", [1, 2, 3, 4, 5, 6, 7], *_kv(7))
    entry, c = cache.lookup("A", [1, 2, 3, 4, 8, 8])
    assert c == 4 and entry.tokens.tolist() == [1, 2, 3, 4, 5]
    assert cache.lookup("A", [1, 2, 3, 4, 5])[1] == 4  # the last prompt token is always prefilled
    assert cache.lookup("A", [7, 7])[1] == 0 and cache.lookup(BASE_SLOT, [1, 2, 3, 4, 5, 6])[1] == 0
    assert cache.stats == {
        "lookups": 4,
        "hits": 2,
        "tokens_looked_up": 6 + 5 + 2 + 6,
        "tokens_reused": 8,
        "evictions": 0,
        "stores": 3,
    }


def test_put_supersedes_prefixes_and_evicts_lru_by_bytes() -> None:
    per_token = 2 * 2 * 2 * 4  # layers x (K, V) x D x 4 bytes
    cache = PrefixCache(10 * per_token)
    cache.put("A", [1, 2], *_kv(2))
    cache.put("A", [1, 2, 3, 4], *_kv(4))  # extends [1, 2]: replaces it
    assert len(cache) == 1 and cache.bytes == 4 * per_token
    cache.put("A", [1, 2, 3], *_kv(3))  # already covered: nothing new stored
    assert len(cache) == 1 and cache.bytes == 4 * per_token
    cache.put("A", [5, 6, 7, 8], *_kv(4))
    cache.lookup("A", [1, 2, 3, 0])  # [1..4] is now the most recently used
    cache.put("A", [9, 9, 9], *_kv(3))  # 11 tokens > 10: the least recently used goes
    assert cache.bytes == 7 * per_token and cache.stats["evictions"] == 1
    assert cache.lookup("A", [5, 6, 7, 0])[1] == 0 and cache.lookup("A", [1, 2, 3, 0])[1] == 3
    cache.put("A", list(range(20)), *_kv(20))  # larger than the whole cache: not stored
    assert cache.bytes == 7 * per_token
    cache.put("B", [4, 4], *_kv(2))
    cache.retain({"B"})
    assert len(cache) == 1 and cache.bytes == 2 * per_token
    off = PrefixCache(0)
    off.put("A", [1, 2, 3], *_kv(3))
    assert len(off) == 0 and off.lookup("A", [1, 2, 3, 4]) == (None, 0)


# ---- the engine, cache on vs off -------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, lora_dirs: dict[str, Path]) -> Any:
    """Two engines on the tiny model, adapters "a" and "b" in each: prefix cache off, and on."""
    torch.set_num_threads(1)
    made = []
    for size in (0, 256 * 2**20):
        engine = Engine(str(tiny_model_dir), threads=1, prefix_cache_bytes=size)
        engine.start()
        for name in ("a", "b"):
            engine.load_adapter(name, str(lora_dirs[name])).result(timeout=60)
        made.append(engine)
    yield made
    for engine in made:
        engine.close()


def _batch(engine: Engine, jobs: list[tuple[list[int], SamplingParams, int, str | None]]) -> list[list[int]]:
    """Submit `jobs` (prompt, params, n, adapter) while the worker is held, so they are admitted
    together; the token ids of each job's rows, in order."""
    hold, held = threading.Event(), threading.Event()

    def wait() -> None:
        held.set()
        hold.wait(30)

    engine.call(wait)
    assert held.wait(30)
    outs: list[list[list[int]]] = [[[] for _ in range(n)] for _, _, n, _ in jobs]
    left = [sum(n for _, _, n, _ in jobs)]
    done = threading.Event()
    for j, (prompt, params, n, adapter) in enumerate(jobs):

        def sink(d: Any, j: int = j) -> None:
            outs[j][d.index].extend(d.token_ids)
            if d.finish_reason is not None:
                assert d.finish_reason in ("stop", "length"), d.finish_reason
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        engine.submit(GenRequest(f"job-{id(outs)}-{j}", prompt, params, sink, n=n, adapter=adapter))
    hold.set()
    assert done.wait(120)
    return [row for rows in outs for row in rows]


def _episodes(engine: Engine, turns: int, greedy: bool) -> list[list[list[int]]]:
    """Agent-shaped traffic: 5 runs (base, a, b, a with n=2, base) taking `turns` calls at once;
    each call's prompt = the last prompt + its completion + a new user turn (as an agent sends it)."""
    tok = engine.tokenizer
    system = tok.encode("You are a helpful agent. Use the tools. " * 4)
    runs = [(None, 1), ("a", 1), ("b", 1), ("a", 2), (None, 1)]
    prompts = [system + tok.encode(f" task {k}" * (k + 1)) for k in range(len(runs))]
    history: list[list[list[int]]] = []
    for turn in range(turns):
        jobs = []
        for k, (adapter, n) in enumerate(runs):
            params = SamplingParams(
                max_tokens=6 + 3 * k,
                temperature=0.0 if greedy else 1.0,
                seed=None if greedy else 100 * turn + k,
                ignore_eos=True,
            )
            jobs.append((prompts[k], params, n, adapter))
        outs = _batch(engine, jobs)
        history.append(outs)
        flat = 0
        for k, (_, n) in enumerate(runs):
            prompts[k] = prompts[k] + outs[flat] + tok.encode(f" tool result {turn} for {k}")
            flat += n
    return history


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_cache_on_equals_cache_off_in_mixed_concurrent_batches(engines: Any, greedy: bool) -> None:
    off, on = engines
    hits, reused = on.prefix_cache.stats["hits"], on.prefix_cache.stats["tokens_reused"]
    assert _episodes(on, 4, greedy) == _episodes(off, 4, greedy)
    assert on.prefix_cache.stats["hits"] - hits >= 5 * 3  # every later call of every run hit
    assert on.prefix_cache.stats["tokens_reused"] - reused > 0
    assert on.stats["prefill_tokens"] < off.stats["prefill_tokens"] / 2
    assert off.prefix_cache.stats["lookups"] == 0 and len(off.prefix_cache) == 0


def test_a_prefix_never_crosses_adapters_and_a_reload_drops_it(
    engines: Any, lora_dirs: dict[str, Path]
) -> None:
    off, on = engines
    prompt = on.tokenizer.encode("the same long prompt for every adapter " * 6)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for engine in engines:
        engine.load_adapter("live", str(lora_dirs["a"])).result(timeout=60)
    want = {m: _batch(off, [(prompt, greedy, 1, m)])[0] for m in (None, "a", "b")}
    assert len({tuple(v) for v in want.values()}) == 3  # the adapters matter on this prompt
    for m in ("a", None, "b", "a"):  # the first one fills the cache under "a" only
        assert _batch(on, [(prompt, greedy, 1, m)])[0] == want[m]
    assert _batch(on, [(prompt, greedy, 1, "live")])[0] == want["a"]
    old_slot = on.adapters.names["live"].name
    assert any(e.slot == old_slot for e in on.prefix_cache._entries.values())
    for engine in engines:  # a new step published under the same name
        engine.load_adapter("live", str(lora_dirs["b"]), load_inplace=True).result(timeout=60)
    assert all(e.slot in on.adapters.live_slots() for e in on.prefix_cache._entries.values())
    assert _batch(on, [(prompt, greedy, 1, "live")])[0] == want["b"]


def test_prefill_computes_logits_at_the_last_position_only(engines: Any) -> None:
    off, _ = engines
    head = off.adapters.base.get_output_embeddings()
    widths: list[int] = []
    hook = head.register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[1]))
    try:
        prompt = off.tokenizer.encode("a prompt of a good many tokens " * 10)
        _batch(off, [(prompt, SamplingParams(max_tokens=3, temperature=0.0), 1, None)])
    finally:
        hook.remove()
    assert widths == [1, 1, 1]  # prefill + 2 decode steps, each (B, 1, hidden) into the LM head


def test_identical_prompts_of_one_admission_are_prefilled_once(engines: Any) -> None:
    off, _ = engines
    prompt = off.tokenizer.encode("the group's first prompt " * 5)
    before = dict(off.stats)
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    together = _batch(off, [(prompt, p, 1, None) for p in seeded] + [(prompt, seeded[0], 3, None)])
    assert off.stats["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    assert off.stats["prompt_tokens"] - before["prompt_tokens"] == 7 * len(prompt)
    alone = [_batch(off, [(prompt, p, 1, None)])[0] for p in seeded]
    assert together[:4] == alone  # each row still samples with its own generator
    assert together[4] == alone[0] and together[5] != together[4]  # n=3: seed, seed + 1, seed + 2
