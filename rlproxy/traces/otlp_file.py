"""`rlproxy export --format otlp | otlp-proto`: the stored runs as OpenTelemetry GenAI spans in a file.

One OTLP `ExportTraceServiceRequest` per run (its trace): its calls' spans and, when it has a reward,
its reward span (`otlp_spans.py`; the same ids as the live export gave them). `otlp`: OTLP/JSON, one
request per line, as the collector's file exporter writes it; `otlp-proto`: binary protobuf, each
request after its size as a varint (protobuf's length-delimited stream, what `rlproxy import
--format otlp-proto` reads). Messages and
tool definitions only with `content`. Runs are read BATCH at a time (storage/export.py), so memory
does not grow with the store; untagged calls (no run) are not exported.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage import export
from rlproxy.traces.otlp_spans import (
    ExportTraceServiceRequest,
    call_span,
    export_request,
    json_line,
    reward_span,
)


def run_request(
    run: dict[str, Any], completions: list[dict[str, Any]], content: bool
) -> ExportTraceServiceRequest:
    """The OTLP request of one run: a span per call, then its reward's."""
    spans = [call_span({**c, "group_id": run.get("group_id")}, content) for c in completions]
    if run.get("reward") is not None:
        at = run.get("completed_at") or (completions[-1].get("created_at") if completions else None)
        spans.append(
            reward_span(
                run["id"],
                run["reward"],
                at,
                reward_source=run.get("reward_source"),
                group_id=run.get("group_id"),
                run_status=run.get("status"),
            )
        )
    return export_request(spans)


async def write(
    engine: AsyncEngine, out: Path, where: str | None = None, content: bool = False, binary: bool = False
) -> int:
    """Write the runs `where` selects to `out` (module doc); returns how many runs were written."""

    async def lines() -> AsyncIterator[bytes]:
        async for run, _messages, completions in export.runs(engine, where):
            request = run_request(run, completions, content)
            if binary:
                data = request.SerializeToString()
                yield _varint(len(data)) + data
            else:
                yield json_line(request)

    return await export.write_lines(Path(out), lines())


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def read_proto(path: Path) -> Iterator[ExportTraceServiceRequest]:
    """The requests of an `otlp-proto` file, in order."""
    data = Path(path).read_bytes()
    at = 0
    while at < len(data):
        size = shift = 0
        while True:
            byte = data[at]
            at += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        yield ExportTraceServiceRequest.FromString(data[at : at + size])
        at += size
