"""Prometheus metrics of one proxy app (its own registry, so several apps can live in one process).

Requests and errors by endpoint and outcome, latency and time-to-first-token histograms, and the
writer's own figures (rows captured, write errors, queue depth) read at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _WriterCollector:
    """Reads the writer's counters when Prometheus scrapes (no bookkeeping on the hot path)."""

    def __init__(self) -> None:
        self.writer = None

    def collect(self):
        w = self.writer
        rows = CounterMetricFamily("rlproxy_captured_rows", "completions rows committed by the writer")
        errors = CounterMetricFamily("rlproxy_write_errors", "failed write attempts of the writer")
        depth = GaugeMetricFamily("rlproxy_write_queue_depth", "records waiting for the writer")
        rows.add_metric([], float(getattr(w, "rows_written", 0) or 0))
        errors.add_metric([], float(getattr(w, "write_errors", 0) or 0))
        depth.add_metric([], float(getattr(w, "depth", 0) or 0))
        return [rows, errors, depth]


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
        self._writer = _WriterCollector()
        r.register(self._writer)
        self._children: dict = {}

    def attach_writer(self, writer) -> None:
        self._writer.writer = writer

    def observe(self, endpoint: str, status: str, latency_s: float, ttft_s: float | None = None) -> None:
        """Count one request (label children cached: this runs on every request)."""
        key = (endpoint, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = (
                self.requests.labels(endpoint, status),
                self.latency.labels(endpoint),
            )
        child[0].inc()
        child[1].observe(latency_s)
        if ttft_s is not None:
            self.ttft.labels(endpoint).observe(ttft_s)
        if status != "ok":
            self.errors.labels(status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
