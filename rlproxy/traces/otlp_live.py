"""Live export: every call handed to the writer, and every reward it stores, sent as OpenTelemetry
GenAI spans (`otlp_spans.py`) to an OTLP/HTTP endpoint (`otlp_endpoint`; protobuf on `/v1/traces`).

Off the hot path: the writer calls `offer` with the record it was handed (`Writer.tap`), and
`offer` only appends it to a bounded deque (~0.1 µs; creating the span there with the OTel SDK cost
~32 µs a call, measured on the dev box, and its trace id cannot be the run's without more). A
task on the serving loop takes a batch every `otlp_interval` seconds (sooner when `otlp_batch_size`
are waiting), builds the spans a few at a time between requests (`encode`), and POSTs them; no
request ever awaits it. Past `otlp_queue_max` waiting, a new span is dropped and counted. A batch the endpoint
refuses or does not answer within `otlp_timeout` is counted failed and not sent again: the store
keeps every call, and `rlproxy export --format otlp` writes them all.

`/metrics`: rlproxy_otlp_spans_exported_total, rlproxy_otlp_spans_dropped_total,
rlproxy_otlp_spans_failed_total and the gauge rlproxy_otlp_queue (this object is the collector).
It is a lifespan service (compose.py): `start` hooks it into the writer, `stop` unhooks it and sends
what is queued, for `otlp_timeout` seconds at most.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rlproxy.settings import TracesSettings
from rlproxy.storage.records import CompletionRecord
from rlproxy.storage.rows import group_of
from rlproxy.storage.runner import Reward
from rlproxy.traces.otlp_spans import (
    ExportTraceServiceResponse,
    add_span,
    call_span,
    export_request,
    reward_span,
)

log = logging.getLogger(__name__)
PATH = "/v1/traces"
CHUNK = 8  # spans built between two turns of the serving loop (`encode`)


def traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to: `endpoint` as is when it ends with /v1/traces, else with it
    appended (as OTEL_EXPORTER_OTLP_ENDPOINT is read)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(PATH) else endpoint + PATH


def parse_headers(spec: str) -> dict[str, str]:
    """`otlp_headers` ("a=b,c=d%20e") as a dict, values percent-decoded (OTEL_EXPORTER_OTLP_HEADERS)."""
    out = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        if sep and name.strip():
            out[name.strip()] = unquote(value.strip())
    return out


def _span(item: CompletionRecord | Reward, content: bool, at: datetime | None) -> Any:
    if isinstance(item, Reward):
        return reward_span(item.run_id, item.reward, at, reward_source="app")  # type: ignore[arg-type]
    call = dict(vars(item))
    # the run's group as the writer gives it to a new run (an untagged call has none)
    call["group_id"] = item.group_id or item.default_group or (group_of(item) if item.run_id else None)
    return call_span(call, content)


async def encode(items: list[tuple[CompletionRecord | Reward, datetime | None]], content: bool) -> bytes:
    """The protobuf body of one export request for `items`, built on the serving loop a few spans
    at a time: a request that comes meanwhile waits for CHUNK spans at most (~0.3 ms), where a
    thread holding the interpreter lock could keep it waiting its whole switch interval (5 ms)."""
    request = export_request()
    for i, (item, at) in enumerate(items, 1):
        add_span(request, _span(item, content, at))
        if i % CHUNK == 0:
            await asyncio.sleep(0)
    return request.SerializeToString()


class OtlpExporter:
    """The live exporter (module doc): `offer` on the writer's path, a task that sends batches."""

    def __init__(self, settings: TracesSettings, writer_of: Any = None, registry: Any = None) -> None:
        """`writer_of`: () -> the Writer to hook into at start (compose.py: the lifespan makes it);
        `registry`: the Prometheus registry that `/metrics` reads, if any."""
        self.settings = settings
        self.url = traces_url(settings.otlp_endpoint)
        self.headers = {**parse_headers(settings.otlp_headers), "Content-Type": "application/x-protobuf"}
        self.writer_of = writer_of
        # (a record or a reward, the time a reward was stored)
        self._queue: collections.deque[tuple[Any, datetime | None]] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.exported = self.dropped = self.failed = 0
        self._up = True  # the last export went through (a warning when that changes, not per batch)
        if registry is not None:
            registry.register(self)

    def offer(self, item: CompletionRecord | Reward) -> None:
        """Queue a record (or a stored reward) for export; never blocks, never raises."""
        if len(self._queue) >= self.settings.otlp_queue_max or self._closing:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("OTLP export: queue full (%d spans), dropping new ones", len(self._queue))
            return
        self._queue.append((item, datetime.now(UTC) if isinstance(item, Reward) else None))
        if len(self._queue) >= self.settings.otlp_batch_size:
            self._wake.set()

    async def start(self) -> None:
        if self.writer_of is not None:
            self.writer_of().tap = self.offer
        self._task = asyncio.create_task(self._run(), name="rlproxy-otlp-export")
        log.info("exporting calls as OTLP spans to %s", self.url)

    async def stop(self) -> None:
        """Unhook from the writer, send what is queued (for `otlp_timeout` at most), stop."""
        if self.writer_of is not None and getattr(self.writer_of(), "tap", None) == self.offer:
            self.writer_of().tap = None
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, self.settings.otlp_timeout)
            except TimeoutError:
                self.dropped += len(self._queue)
                self._queue.clear()
                log.warning(
                    "OTLP export: spans left unsent at shutdown after %gs", self.settings.otlp_timeout
                )
        log.info(
            "OTLP export stopped: %d spans exported, %d dropped, %d failed",
            self.exported,
            self.dropped,
            self.failed,
        )

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=self.settings.otlp_timeout) as client:
            while not (self._closing and not self._queue):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.settings.otlp_interval)
                self._wake.clear()
                while self._queue:
                    n = min(len(self._queue), self.settings.otlp_batch_size)
                    await self._send(client, [self._queue.popleft() for _ in range(n)])
                    if len(self._queue) < self.settings.otlp_batch_size and not self._closing:
                        break  # a partial batch waits for the next interval

    async def _send(self, client: httpx.AsyncClient, batch: list[tuple[Any, datetime | None]]) -> None:
        try:
            body = await encode(batch, self.settings.otlp_capture_content)
            resp = await client.post(self.url, content=body, headers=self.headers)
            resp.raise_for_status()
        except asyncio.CancelledError:  # shutdown's deadline passed while this batch was out
            self.failed += len(batch)
            raise
        except Exception as exc:  # a dead or slow endpoint costs its spans, never a request
            if self._up:
                log.warning("OTLP export to %s failed (%d spans): %s", self.url, len(batch), exc)
            self._up = False
            self.failed += len(batch)
            return
        if not self._up:
            log.info("OTLP export to %s works again", self.url)
        self._up = True
        rejected = 0
        with contextlib.suppress(Exception):  # a 200 with an empty or JSON body: all taken
            rejected = ExportTraceServiceResponse.FromString(resp.content).partial_success.rejected_spans
        self.failed += rejected
        self.exported += len(batch) - rejected

    def collect(self) -> list[Any]:
        """Prometheus: spans exported, dropped (queue full) and failed (endpoint), and the queue."""
        out: list[Any] = []
        for name, value, doc in (
            ("exported", self.exported, "spans the OTLP endpoint accepted"),
            ("dropped", self.dropped, "spans dropped because the export queue was full"),
            ("failed", self.failed, "spans the OTLP endpoint refused or did not answer for"),
        ):
            out.append(CounterMetricFamily(f"rlproxy_otlp_spans_{name}", doc, value=value))
        out.append(
            GaugeMetricFamily("rlproxy_otlp_queue", "spans waiting for export", value=len(self._queue))
        )
        return out
