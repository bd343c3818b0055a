"""Issue 55, item 3: the embedded engine's prefix cache is per app key.

Through a real proxy in front of the session's embedded engine (tiny model, prefix cache on): key A
sends a long prompt; key B's probe of the same prompt takes as long as a prompt nobody sent (no hit
across keys), and A's own repeat is still a hit. Before issue 55 the cache was keyed by adapter
only: B's probe reused A's KV (the issue measured 21 ms against 157 ms for a miss).
"""

from __future__ import annotations

import random
import statistics
import time

import httpx

from rlproxy.inference.prefix_cache import PrefixCache
from rlproxy.storage import keys as keystore

WORDS = "apple river stone cloud paper light garden window music silver number orange forest".split()


def _key(proxy, name: str) -> dict[str, str]:
    _, secret = proxy.lt.run(keystore.create(proxy.state.engine, name))
    proxy.lt.run(proxy.state.keys.refresh())
    return {"Authorization": f"Bearer {secret}"}


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(350))


def _timed(proxy, auth, text: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    t0 = time.perf_counter()
    answer = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=auth, timeout=120)
    took = time.perf_counter() - t0
    assert answer.status_code == 200, answer.text
    return took


def test_no_prefix_cache_hit_across_keys(make_proxy, engine_backend, tiny_model_dir):
    proxy = make_proxy(engine_backend.base_url, model=str(tiny_model_dir), api_key="shared")
    model = "tiny"
    a, b = _key(proxy, "app-a"), _key(proxy, "app-b")
    stats = engine_backend.engine.prefix_cache.stats
    rng = random.Random(55)
    probes, misses, repeats = [], [], []
    for _ in range(5):
        secret, fresh = _prompt(rng), _prompt(rng)
        _timed(proxy, a, secret, model)  # A's prompt, now in the cache under A's key
        reused = stats["tokens_reused"]
        probes.append(_timed(proxy, b, secret, model))  # B probes A's prompt
        assert stats["tokens_reused"] - reused < 50  # at most the chat template's head, B's own
        misses.append(_timed(proxy, b, fresh, model))  # a prompt nobody sent
        reused = stats["tokens_reused"]
        repeats.append(_timed(proxy, a, secret, model))  # A again: its own cache still works
        assert stats["tokens_reused"] - reused > 800
    probe, miss, repeat = (statistics.median(x) for x in (probes, misses, repeats))
    assert probe > 0.6 * miss, (probe, miss)  # a hit would be a fraction of a miss
    assert repeat < probe, (repeat, probe)


def test_prefix_cache_entries_are_per_salt():
    import torch

    cache = PrefixCache(1 << 20)
    kv = [torch.zeros(1, 4, 2)]
    cache.put("base", [1, 2, 3, 4], kv, kv, salt="key_a")
    assert cache.lookup("base", [1, 2, 3, 4, 5], "key_b") == (None, 0)
    assert cache.lookup("base", [1, 2, 3, 4, 5]) == (None, 0)  # unsalted: the shared agents' key
    assert cache.lookup("base", [1, 2, 3, 4, 5], "key_a")[1] == 4
