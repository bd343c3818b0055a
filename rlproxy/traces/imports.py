"""`rlproxy import`: trace files -> runs of text-only calls, streamed in bounded memory, stored once.

    file (.jsonl[.gz], OTLP .json lines, OTLP protobuf) ──> records, one at a time (`records`)
        ──> a reader per record (readers/: pure) ──> calls + notes, batched (BATCH calls)
        ──> one write transaction per batch: calls already stored dropped (capture_id), the rest
            written by the capture path's own rows (`rows.ensure_runs`, `rows.insert_completions`),
            their runs marked `skipped` / `imported`, scores applied as rewards

Imported calls are stored as a hosted provider's are (token ids NULL, `completions.source`
'import'): never GRPO samples (their runs are `skipped` with status_reason `imported` at once, so the
trainer never selects them), always SFT and distillation data (`rlproxy sft --from-source import`).
A trace is a run (`import:<trace id>`); its calls get `seq` in the order they are read (time order
within one OTLP request); spans of one trace spread over several requests or files join the same run.
A call's policy is its model's name, or the `policy` the import names (`rlproxy import --policy
agent`): the policy whose siblings' `imported` mode samples its prompts (trainer/siblings.py); the
model stays in `completions.adapter` and the request.

Memory: one record and one batch at a time, whatever the file's size (JSONL and OTLP/JSON line by
line; OTLP protobuf one `ResourceSpans` or one length-delimited request at a time), plus one small
note per trace whose score was read before any of its calls (applied at the end).
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, Literal

import orjson
from sqlalchemy import case, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.errors import ConfigError
from rlproxy.storage.db import write_transaction
from rlproxy.storage.models import RunStatus
from rlproxy.storage.records import CompletionRecord
from rlproxy.storage.rows import RUNS, ensure_runs, insert_completions, stored_capture_ids
from rlproxy.storage.training import StatusReason
from rlproxy.traces.readers import Malformed, Read, RunNote
from rlproxy.traces.readers.langfuse import read_langfuse
from rlproxy.traces.readers.langsmith import read_langsmith
from rlproxy.traces.readers.openai import read_chat
from rlproxy.traces.readers.otlp import read_request

log = logging.getLogger(__name__)

BATCH = 500  # calls per write transaction
READERS: dict[str, Callable[[dict[str, Any]], Read]] = {
    "otlp": read_request,
    "openai-jsonl": read_chat,
    "langfuse": read_langfuse,
    "langsmith": read_langsmith,
}
Format = Literal["auto", "otlp", "otlp-proto", "openai-jsonl", "langfuse", "langsmith"]
PROTO_SUFFIXES = {".pb", ".binpb", ".protobuf"}


@dataclass
class Summary:
    """What an import did, in calls (model calls; a trace's calls make one run)."""

    imported: int = 0
    duplicates: int = 0  # calls stored already (an earlier import of the same source)
    malformed: int = 0  # records reported and skipped
    runs: int = 0  # runs created
    scores: int = 0  # runs given a score as their reward

    def line(self) -> str:
        return (
            f"imported {self.imported} call(s) in {self.runs} new run(s), {self.scores} scored; "
            f"{self.duplicates} already there; {self.malformed} malformed"
        )


def detect(record: dict[str, Any]) -> str:
    """The format of one JSON record (`--format auto`), by the fields each source writes."""
    if "resourceSpans" in record:
        return "otlp"
    if "run_type" in record or "dotted_order" in record or ("key" in record and "run_id" in record):
        return "langsmith"
    if "observations" in record or isinstance(record.get("data"), list) or "traceId" in record:
        return "langfuse"
    if "trace_id" in record and ("type" in record or "data_type" in record):
        return "langfuse"
    return "openai-jsonl"


def records(path: Path, fmt: Format = "auto") -> Iterator[tuple[int, int, Read | Malformed]]:
    """(record number (a JSONL line: its line number), bytes of the file read so far, what its reader
    made of it or the Malformed saying why not), one record at a time; gzip files unpacked as read."""
    with path.open("rb") as raw:
        f: Any = gzip.GzipFile(fileobj=raw) if raw.peek(2)[:2] == b"\x1f\x8b" else raw
        first = f.peek(1)[:1]
        proto = fmt == "otlp-proto" or (
            fmt == "auto" and (path.suffix in PROTO_SUFFIXES or (first and first not in b"{[ \t\r\n"))
        )
        if proto:
            for n, read in _proto_records(f):
                yield n, raw.tell(), read
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
                if not isinstance(record, dict):
                    raise Malformed("not a JSON object")
                read: Read | Malformed = READERS[detect(record) if fmt == "auto" else fmt](record)
            except Exception as exc:  # noqa: BLE001 - bad JSON, a reader's Malformed, a shape it did not expect
                read = _malformed(exc)
            yield n, raw.tell(), read


def _malformed(exc: Exception) -> Malformed:
    return exc if isinstance(exc, Malformed) else Malformed(f"{type(exc).__name__}: {exc}")


def _varint(f: IO[bytes]) -> int | None:
    shift = value = 0
    while True:
        b = f.read(1)
        if not b:
            if shift:
                raise Malformed("the file ends inside a length")
            return None
        value |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return value
        shift += 7


def _proto_records(f: Any) -> Iterator[tuple[int, Read | Malformed]]:
    """OTLP protobuf: one ExportTraceServiceRequest (read one ResourceSpans at a time: the message
    is field 1 repeated, tag 0x0A) or length-delimited requests (a varint length before each)."""
    try:
        from google.protobuf import json_format
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans
    except ImportError as exc:
        raise ConfigError("OTLP protobuf files need the traces extra: pip install 'rlproxy[traces]'") from exc
    single = f.peek(1)[:1] == b"\x0a"
    n = 0
    while True:
        if single:
            tag = f.read(1)
            if not tag:
                return
            size = _varint(f)
        else:
            size = _varint(f)
        if size is None:
            return
        n += 1
        data = f.read(size)
        try:
            if len(data) < size:
                raise Malformed("the file ends inside a message")
            if single:
                if tag != b"\x0a":
                    raise Malformed(f"not an OTLP trace request (field tag {tag.hex()})")
                msg = {"resourceSpans": [json_format.MessageToDict(ResourceSpans.FromString(data))]}
            else:
                msg = json_format.MessageToDict(ExportTraceServiceRequest.FromString(data))
            yield n, read_request(msg)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and a reader's errors alike
            yield n, _malformed(exc)


async def import_files(
    engine: AsyncEngine,
    paths: list[Path],
    fmt: Format = "auto",
    *,
    score: str | None = None,
    policy: str | None = None,
    on_malformed: Callable[[str], None] = log.warning,
    on_progress: Callable[[int], None] | None = None,
) -> Summary:
    """Import `paths` into the store of `engine` (migrated); `score` names the score that becomes a
    run's reward when a trace has several (else its first); `policy` the policy every call is stored
    under (else its model's name). Returns what was done."""
    summary = Summary()
    pending: dict[str, RunNote] = {}  # notes of runs not stored yet
    calls: list[CompletionRecord] = []
    for path in paths:
        seen = 0
        for n, done, read in records(path, fmt):
            if on_progress is not None:
                on_progress(done - seen)
            seen = done
            if isinstance(read, Malformed):
                summary.malformed += 1
                on_malformed(f"{path}:{n}: {read}")
                continue
            if policy is not None:
                for c in read.calls:
                    c.policy = policy
            calls += read.calls
            for note in read.notes:
                _merge(pending, note, score)
            if len(calls) >= BATCH:
                await _store(engine, calls, pending, summary)
                calls = []
    await _store(engine, calls, pending, summary)
    if pending:
        log.info("%d score(s) name traces with no imported call: left out", len(pending))
    return summary


def _merge(notes: dict[str, RunNote], note: RunNote, score: str | None) -> None:
    have = notes.get(note.run_id)
    if have is None:
        notes[note.run_id] = note
        return
    have.metrics.update(note.metrics)
    have.metadata.update(note.metadata)
    if have.reward is None or (score is not None and score in note.metrics):
        have.reward, have.reward_source = note.reward, note.reward_source
    if score is not None and score in have.metrics:
        have.reward = have.metrics[score]


async def _store(
    engine: AsyncEngine, calls: list[CompletionRecord], notes: dict[str, RunNote], summary: Summary
) -> None:
    """One transaction: the batch's new calls (via the capture path's rows), their runs marked
    imported, and the notes of every run that now exists (removed from `notes`)."""
    now = datetime.now(UTC)
    async with write_transaction(engine) as conn:
        have = (
            await stored_capture_ids(conn, [c.capture_id for c in calls if c.capture_id]) if calls else set()
        )
        fresh: dict[str, CompletionRecord] = {}
        for c in calls:
            if c.capture_id in have or c.capture_id in fresh:
                summary.duplicates += 1
            else:
                fresh[c.capture_id or ""] = c
        new = list(fresh.values())
        first = await ensure_runs(conn, new) if new else {}
        await insert_completions(conn, new, first, now)
        summary.imported += len(new)
        summary.runs += sum(1 for seq in first.values() if seq == 0)
        ended: dict[str, datetime] = {}
        for c in new:
            end = (c.created_at or now) + timedelta(milliseconds=c.latency_ms or 0)
            ended[c.run_id or ""] = max(end, ended.get(c.run_id or "", end))
        changes: dict[str, dict[str, Any]] = {}
        for rid, end in ended.items():
            # completed_at: the latest end of its calls (a trace may come in several batches): load_runs
            # reads the calls made before it
            later = RUNS.c.completed_at.is_(None) | (RUNS.c.completed_at < end)
            changes[rid] = {
                "status": RunStatus.skipped,
                "status_reason": StatusReason.imported,
                "completed_at": case((later, end), else_=RUNS.c.completed_at),
            }
        if notes:
            stored = set((await conn.execute(select(RUNS.c.id).where(RUNS.c.id.in_(list(notes))))).scalars())
            for rid in stored:
                note = notes.pop(rid)
                score = {"reward": note.reward, "reward_source": note.reward_source, "metrics": note.metrics}
                changes[rid] = {**changes.get(rid, {}), **score, "metadata": note.metadata}
                summary.scores += 1
        for rid, values in changes.items():
            await conn.execute(update(RUNS).where(RUNS.c.id == rid).values(**values))
