"""Prometheus metrics of one proxy app (its own registry, so several apps can live in one process).

Requests and errors by endpoint and outcome, latency and time-to-first-token histograms, and the
writer's own figures read at scrape time: rows captured, write errors, dropped records, queue depth
and bytes, how long the store has been stalled (and whether that makes it unhealthy), the crash
journal's size and the records it could not take. The event loop's lag (`rlproxy_event_loop_lag_seconds`):
how late a timer set every `LAG_INTERVAL_S` fires while requests come (every `LAG_IDLE_INTERVAL_S`
once none has for `LAG_IDLE_AFTER_S`), i.e. how long any ready request waited for the loop at that
moment; a stall (blocking work on the loop, a long garbage collection) shows in its upper buckets.
The judge's calls (trainer/judge.py): count by outcome (ok, malformed, error), latency, tokens (its
cost), and groups scored or failed. Siblings (trainer/siblings.py): answers, tokens and engine
seconds sampled, groups by outcome, the queue, requests in flight and the last minute's engine share.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# The lag sampler's period while requests come: 100 wake-ups a second; a stall of any length that
# overlaps a wake-up is seen whole. Waking an idle process costs far more than the sample: on a 2-core
# VM 100 wake-ups a second took 20 ms of CPU a second, an idle proxy's whole CPU. So once no request
# has been in flight for LAG_IDLE_AFTER_S it samples every LAG_IDLE_INTERVAL_S (~1 ms of CPU a second),
# until a wake-up finds one again (within LAG_IDLE_INTERVAL_S of the first).
LAG_INTERVAL_S = 0.01
LAG_IDLE_INTERVAL_S = 0.25
LAG_IDLE_AFTER_S = 1.0
_LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _WriterCollector:
    """Reads the writer's counters when Prometheus scrapes (no bookkeeping on the hot path)."""

    def __init__(self) -> None:
        self.writer = None
        self.runs = None  # runstate.RunState
        self.unhealthy_after = 30.0

    def collect(self):
        w = self.writer

        def num(name: str) -> float:
            return float(getattr(w, name, 0) or 0)

        journal = getattr(w, "journal", None)
        stalled = w.stalled_for() if w is not None else 0.0
        out = []
        for kind, name, doc, value in (
            (
                CounterMetricFamily,
                "rlproxy_captured_rows",
                "completions rows committed by the writer",
                num("rows_written"),
            ),
            (
                CounterMetricFamily,
                "rlproxy_write_commits",
                "transactions the writer committed (rows_written / commits: rows per batch)",
                num("commits"),
            ),
            (
                CounterMetricFamily,
                "rlproxy_write_errors",
                "failed write attempts of the writer",
                num("write_errors"),
            ),
            (
                CounterMetricFamily,
                "rlproxy_write_dropped",
                "completions the writer gave up on (unstorable; logged with their run id)",
                num("dropped"),
            ),
            (
                CounterMetricFamily,
                "rlproxy_writer_restarts",
                "writer processes that died and were replaced (each sent everything not yet committed)",
                num("restarts"),
            ),
            (
                GaugeMetricFamily,
                "rlproxy_writer_idle_priority",
                "1 while the writer process runs at the scheduler's idle priority (0: normal, or replaced"
                " at normal priority after it starved there)",
                num("idle_priority"),
            ),
            (GaugeMetricFamily, "rlproxy_write_queue_depth", "records waiting for the writer", num("depth")),
            (
                GaugeMetricFamily,
                "rlproxy_write_queue_bytes",
                "bytes of records waiting for the writer",
                num("queue_bytes"),
            ),
            (
                GaugeMetricFamily,
                "rlproxy_store_stalled_seconds",
                "seconds work has waited without a commit",
                stalled,
            ),
            (
                GaugeMetricFamily,
                "rlproxy_store_healthy",
                "0 while the store has not committed for over store_unhealthy_after s (/healthz is 503)",
                0.0 if stalled > self.unhealthy_after else 1.0,
            ),
            (
                GaugeMetricFamily,
                "rlproxy_journal_bytes",
                "bytes in the crash journal",
                float(getattr(journal, "size", 0)),
            ),
            (
                CounterMetricFamily,
                "rlproxy_journal_skipped",
                "completions not journaled (journal full or unwritable): a kill -9 could lose them",
                float(getattr(journal, "skipped", 0)),
            ),
            (
                CounterMetricFamily,
                "rlproxy_journal_replayed",
                "journal records stored on start",
                num("replayed"),
            ),
        ):
            family = kind(name, doc)
            family.add_metric([], value)
            out.append(family)
        if self.runs is not None:  # only once attached: a missing hookup shows as a missing metric
            late = CounterMetricFamily(
                "rlproxy_late_turns",
                "turns admitted to a run the background check then found closed (stored, never trained)",
            )
            late.add_metric([], float(self.runs.late))
            out.append(late)
        # the writer's last failure in full (admin route; /healthz shows only its class: issue 22)
        last = getattr(w, "last_error", None)
        if last:
            info = GaugeMetricFamily(
                "rlproxy_store_last_error",
                "the writer's last failed transaction (1 while failing)",
                labels=["error"],
            )
            info.add_metric([last[:500]], 1.0)
            out.append(info)
        return out


class _UpstreamsCollector:
    """Each upstream replica's state when Prometheus scrapes (several upstreams only; by index)."""

    def __init__(self) -> None:
        self.pool = None  # upstreams.Upstreams

    def collect(self):
        if self.pool is None:
            return []
        inflight = GaugeMetricFamily(
            "rlproxy_upstream_inflight", "requests in flight on each upstream replica", labels=["replica"]
        )
        healthy = GaugeMetricFamily(
            "rlproxy_upstream_healthy",
            "1 while an upstream replica takes traffic, 0 while it is ejected or being given its adapters",
            labels=["replica"],
        )
        ejections = CounterMetricFamily(
            "rlproxy_upstream_ejections", "times each upstream replica was ejected", labels=["replica"]
        )
        for r in self.pool.snapshot():
            label = [str(r["replica"])]
            inflight.add_metric(label, float(r["inflight"]))
            healthy.add_metric(label, 1.0 if r["state"] == "healthy" else 0.0)
            ejections.add_metric(label, float(r["ejections"]))
        return [inflight, healthy, ejections]


class _SiblingsCollector:
    """The siblings service's figures (trainer/siblings.py `stats()`), read at scrape time."""

    # (name after rlproxy_siblings_, key in stats(), help)
    COUNTERS = (
        ("sampled", "sampled", "sibling answers sampled and stored"),
        ("tokens", "tokens", "tokens the sibling answers sampled"),
        ("engine_seconds", "engine_seconds", "wall time of sibling requests on the engine"),
    )
    GAUGES = (
        ("queue", "queue", "calls waiting to be branched"),
        ("in_flight", "in_flight", "sibling requests on the engine now"),
        ("engine_share", "share", "share of the last minute with a sibling request on the engine (0-1)"),
    )

    def __init__(self, service) -> None:
        self.service = service

    def collect(self):
        s = self.service.stats()
        for name, key, doc in self.COUNTERS:
            yield CounterMetricFamily(f"rlproxy_siblings_{name}", doc, value=s[key])
        groups = CounterMetricFamily(
            "rlproxy_siblings_groups",
            "sibling groups by outcome: scored, failed (sampling or scorer), dropped (queue full)",
            labels=["outcome"],
        )
        for outcome in ("scored", "failed", "dropped"):
            groups.add_metric([outcome], s[outcome])
        yield groups
        for name, key, doc in self.GAUGES:
            yield GaugeMetricFamily(f"rlproxy_siblings_{name}", doc, value=s[key])


class Metrics:
    """The proxy's metrics; `observe` is called once per proxied request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rlproxy_requests", "proxied requests by endpoint and outcome", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "rlproxy_request_latency_seconds",
            "time to the last byte",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "rlproxy_ttft_seconds",
            "time to the first token of streams",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.errors = Counter("rlproxy_errors", "errors by kind", ["kind"], registry=r)
        self.policy_step = Gauge("rlproxy_policy_step", "step each policy serves", ["policy"], registry=r)
        # the judge (trainer/judge.py calls judge_call / judge_group through compose.py's wiring)
        self.judge_calls = Counter(
            "rlproxy_judge_calls", "judge calls by outcome: ok, malformed, error", ["outcome"], registry=r
        )
        self.judge_latency = Histogram(
            "rlproxy_judge_latency_seconds", "time of one judge call", buckets=_BUCKETS, registry=r
        )
        self.judge_tokens = Counter(
            "rlproxy_judge_tokens",
            "tokens of judge calls (their cost) by kind: prompt, completion",
            ["kind"],
            registry=r,
        )
        self.judge_groups = Counter(
            "rlproxy_judge_groups",
            "groups the judge scored, or failed (judge_failed)",
            ["outcome"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "rlproxy_event_loop_lag_seconds",
            f"how late a timer due every {LAG_INTERVAL_S:g} s (every {LAG_IDLE_INTERVAL_S:g} s when no"
            " request came for a while) fires: what a ready request waits for the loop",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self._writer = _WriterCollector()
        r.register(self._writer)
        self._children: dict = {}
        self._ttft: dict = {}

    def attach_upstreams(self, pool) -> None:
        """Report each replica of `pool` (an `upstreams.Upstreams`): in flight, healthy, ejections."""
        if not hasattr(self, "_upstreams"):
            self._upstreams = _UpstreamsCollector()
            self.registry.register(self._upstreams)
        self._upstreams.pool = pool

    def attach_writer(self, writer, unhealthy_after: float = 30.0) -> None:
        """Report `writer`'s figures; the store counts as unhealthy after `unhealthy_after` s stalled."""
        self._writer.writer = writer
        self._writer.unhealthy_after = unhealthy_after

    def attach_siblings(self, service) -> None:
        """Report the siblings service's figures (`rlproxy_siblings_*`)."""
        self.registry.register(_SiblingsCollector(service))

    def attach_runs(self, runs) -> None:
        """Report `runs`' (a `runstate.RunState`) late turns."""
        self._writer.runs = runs

    def observe(self, endpoint: str, status: str, latency_s: float, ttft_s: float | None = None) -> None:
        """Count one request (label children cached: this runs on every request)."""
        key = (endpoint, status)
        child = self._children.get(key)
        if child is None:  # (`labels()` checks and hashes its values under a lock: ~5 us a call)
            child = self._children[key] = (
                self.requests.labels(endpoint, status),
                self.latency.labels(endpoint),
                self.errors.labels(status) if status != "ok" else None,
            )
        child[0].inc()
        child[1].observe(latency_s)
        if child[2] is not None:
            child[2].inc()
        if ttft_s is not None:  # a stream's (its series appears with the endpoint's first stream)
            ttft = self._ttft.get(endpoint)
            if ttft is None:
                ttft = self._ttft[endpoint] = self.ttft.labels(endpoint)
            ttft.observe(ttft_s)

    def judge_call(self, outcome: str, seconds: float, prompt_tokens: int, completion_tokens: int) -> None:
        """Count one judge call (outcome ok, malformed or error) with its latency and tokens."""
        self.judge_calls.labels(outcome).inc()
        self.judge_latency.observe(seconds)
        self.judge_tokens.labels("prompt").inc(prompt_tokens)
        self.judge_tokens.labels("completion").inc(completion_tokens)

    def judge_group(self, outcome: str) -> None:
        """Count one group the judge finished: scored or failed."""
        self.judge_groups.labels(outcome).inc()

    async def watch_loop(
        self,
        busy: Callable[[], bool] = lambda: True,
        interval: float = LAG_INTERVAL_S,
        idle_interval: float = LAG_IDLE_INTERVAL_S,
        idle_after: float = LAG_IDLE_AFTER_S,
    ) -> None:
        """Forever: sample the running loop's lag into `loop_lag` (a lifespan task), every `interval`
        seconds, or every `idle_interval` once `busy()` (a request in flight, or one begun since it
        was last asked: `Limits.busy`) has been false for `idle_after` seconds."""
        # perf_counter, not loop.time(): uvloop's clock is libuv's cached millisecond, so every
        # sample would be a whole millisecond (0, 1, 2 ms) and a 1.0 ms one lands in the 2 ms bucket
        clock = time.perf_counter
        observe = self.loop_lag.observe
        last_busy = clock()
        while True:
            now = clock()
            if busy():
                last_busy = now
            step = interval if now - last_busy < idle_after else idle_interval
            due = now + step
            await asyncio.sleep(step)
            observe(max(0.0, clock() - due))

    def render(self) -> bytes:
        return generate_latest(self.registry)
