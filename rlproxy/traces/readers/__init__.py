"""Readers: pure functions from one source record (a JSON line, an OTLP request) to what the store keeps.

Each reader takes one parsed record and returns a `Read`: the model calls it holds as
`CompletionRecord`s (text only, as a hosted upstream's rows: token ids NULL, `source` 'import') and
what it says about their runs (`RunNote`: a score as the reward, times, the source's ids). A record
a reader cannot use raises `Malformed` (the importer reports its line and goes on); a record that
holds no model call (a tool span, a trace's root) reads as an empty `Read`.

Ids are the source's: a trace is the run `import:<trace id>` and a call's `capture_id` is
`import:<trace id>:<span id>` (hashed when longer than the columns hold), so a second import of the
same file finds every call stored already (`imports.py`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rlproxy.storage.records import CompletionRecord, Endpoint, as_count

IMPORT = "import"  # completions.source of an imported call (text only, as `hosted`)
_RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # what X-Run-Id allows (proxy/runkey.py)


class Malformed(ValueError):
    """A record a reader cannot turn into calls: the importer reports it (with its line) and skips it."""


@dataclass
class RunNote:
    """What a record says about the run of a trace beyond its calls (merged per run by the importer)."""

    run_id: str
    reward: float | None = None
    reward_source: str | None = None  # langfuse, langsmith: whose score `reward` is
    metrics: dict[str, float] = field(default_factory=dict)  # every numeric score, by name
    metadata: dict[str, Any] = field(default_factory=dict)  # the source's ids and names
    ended_at: datetime | None = None


@dataclass
class Read:
    """A record's calls and notes."""

    calls: list[CompletionRecord] = field(default_factory=list)
    notes: list[RunNote] = field(default_factory=list)


def run_key(trace_id: str) -> str:
    """The run id of a trace: `import:<trace id>`, or `import:<sha256 prefix>` when the id does not
    fit a run id (characters, length)."""
    rid = f"import:{trace_id}"
    return rid if _RUN_ID.fullmatch(rid) else f"import:{_digest(trace_id)}"


def capture_key(trace_id: str, span_id: str) -> str:
    """A call's `capture_id` (64 characters at most): unique per source call, the same every import."""
    for key in (f"import:{trace_id}:{span_id}", f"import:{span_id}"):
        if len(key) <= 64:
            return key
    return f"import:{_digest(trace_id, span_id)}"


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:40]


def timestamp(value: Any) -> datetime | None:
    """A UTC time from nanoseconds since the epoch (OTLP), seconds (OpenAI), or ISO 8601 text."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, datetime):
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, str) and not value.isdigit():
        try:
            return timestamp(datetime.fromisoformat(value.replace("Z", "+00:00")))
        except ValueError:
            raise Malformed(f"not a time: {value!r}") from None
    n = int(value)
    return datetime.fromtimestamp(n / 1e9 if n > 10**14 else n, UTC)


def chat_call(
    *,
    trace_id: str,
    span_id: str,
    model: str | None,
    messages: list[dict[str, Any]],
    reply: dict[str, Any] | None,
    tools: list[Any] | None = None,
    params: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    usage: tuple[Any, Any] = (None, None),
    started: datetime | None = None,
    ended: datetime | None = None,
    response_id: str | None = None,
) -> CompletionRecord:
    """One imported chat call as the store keeps a hosted provider's: the request the client sent
    (model, messages, tools, parameters) and a chat.completion response holding `reply`."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise Malformed("its messages are not a list of objects")
    request: dict[str, Any] = {"model": model, "messages": messages}
    if tools:
        request["tools"] = tools
    request.update({k: v for k, v in (params or {}).items() if k not in request and v is not None})
    prompt_tokens, completion_tokens = as_count(usage[0]), as_count(usage[1])
    response = None
    if reply is not None:
        reply = {"role": "assistant", **reply}
        response = {
            "id": response_id or f"import-{span_id}",
            "object": "chat.completion",
            "created": int(started.timestamp()) if started else None,
            "model": model,
            "choices": [{"index": 0, "message": reply, "finish_reason": finish_reason}],
        }
        if prompt_tokens is not None or completion_tokens is not None:
            response["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": (prompt_tokens or 0) + (completion_tokens or 0),
            }
    latency = (ended - started).total_seconds() * 1000 if started and ended else None
    return CompletionRecord(
        run_id=run_key(trace_id),
        policy=model,
        adapter=model,
        endpoint=Endpoint.CHAT,
        stream=False,
        request=request,
        response=response,
        finish_reason=finish_reason,
        status="ok" if response is not None else "error",
        status_code=200 if response is not None else None,
        error=None if response is not None else "imported without a reply",
        latency_ms=latency,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        created_at=started,
        capture_id=capture_key(trace_id, span_id),
        source=IMPORT,
    )
