"""The embedded engine's figures as Prometheus metrics, read when the proxy's /metrics is scraped.

The proxy keeps its own registry (proxy/metrics.py); the composition root registers this collector
there when the backend offers one (`EmbeddedBackend.metrics_collector`). Reading the engine's plain
counters costs nothing on the worker thread; a scrape may see one step's counters half updated.

    rlproxy_engine_tokens                   tokens decoded (sampled), all rows
    rlproxy_engine_prompt_tokens            prompt positions admitted (what a naive prefill would run)
    rlproxy_engine_prefill_tokens           prompt positions actually run through the model
    rlproxy_engine_prefill_seconds          worker seconds spent prefilling (with each new row's first token)
    rlproxy_engine_decode_seconds           worker seconds spent in decode steps
    rlproxy_engine_decode_steps             decode steps; _decode_rows the rows they carried, summed
    rlproxy_engine_cancelled                rows dropped because their client left
    rlproxy_engine_rows                     rows decoding now
    rlproxy_engine_prefix_cache_lookups     distinct prompts looked up in the prefix cache
    rlproxy_engine_prefix_cache_hits        lookups that reused at least one token
    rlproxy_engine_prefix_cache_hit_tokens  prompt tokens served from the cache (not prefilled)
    rlproxy_engine_prefix_cache_bytes       bytes of KV held, and _limit_bytes its bound
    rlproxy_engine_prefix_cache_entries     entries held; _evictions how many were evicted
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# name: help, of the engine's counters `stats[name]`
_COUNTERS = {
    "tokens": "tokens decoded (sampled)",
    "prompt_tokens": "prompt positions admitted",
    "prefill_tokens": "prompt positions run through the model (the rest came from the prefix cache or "
    "a twin)",
    "prefill_seconds": "worker seconds prefilling",
    "decode_seconds": "worker seconds decoding",
    "decode_steps": "decode steps",
    "decode_rows": "rows of decode steps, summed",
    "cancelled": "rows dropped because their client left",
}
# name: (key in the prefix cache's stats, help)
_CACHE_COUNTERS = {
    "prefix_cache_lookups": ("lookups", "distinct prompts looked up"),
    "prefix_cache_hits": ("hits", "lookups that reused a prefix"),
    "prefix_cache_hit_tokens": ("tokens_reused", "prompt tokens served from the prefix cache"),
    "prefix_cache_evictions": ("evictions", "entries evicted"),
}


class EngineCollector:
    """Collects from whatever engine `get_engine()` returns (None: nothing to report)."""

    def __init__(self, get_engine: Callable[[], Any]) -> None:
        self.get_engine = get_engine

    def describe(self) -> list:
        return []  # no samples at registration time: the engine may not be started yet

    def collect(self) -> Iterator[Any]:
        engine = self.get_engine()
        if engine is None:
            return
        stats, cache = dict(engine.stats), engine.prefix_cache
        cstats = dict(cache.stats)
        rows = [(CounterMetricFamily, name, doc, stats[name]) for name, doc in _COUNTERS.items()]
        rows.append((GaugeMetricFamily, "rows", "rows decoding now", len(getattr(engine, "_rows", []))))
        rows += [
            (CounterMetricFamily, name, doc, cstats[key]) for name, (key, doc) in _CACHE_COUNTERS.items()
        ]
        rows += [
            (GaugeMetricFamily, "prefix_cache_bytes", "bytes of KV in the prefix cache", cache.bytes),
            (GaugeMetricFamily, "prefix_cache_limit_bytes", "the prefix cache's bound", cache.max_bytes),
            (GaugeMetricFamily, "prefix_cache_entries", "entries in the prefix cache", len(cache)),
        ]
        for kind, name, doc, value in rows:
            family = kind(f"rlproxy_engine_{name}", doc)
            family.add_metric([], float(value))
            yield family
