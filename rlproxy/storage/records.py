"""What the proxy hands the writer for one model call: a plain dataclass, no ORM, no I/O.

The proxy builds it on the request path and `Writer.submit`s it; the writer alone turns it into
rows (it assigns `seq` and creates the run). Field names match the `completions` columns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import orjson


class Endpoint(StrEnum):
    """The upstream's two completion forms: the `completions.endpoint` values of the OpenAI routes
    (an API served over chat stores its own name: `responses`, `messages`; proxy/apis.py)."""

    CHAT = "chat.completions"  # POST /v1/chat/completions
    COMPLETIONS = "completions"  # POST /v1/completions


@dataclass
class CompletionRecord:
    """One captured model call, as the client saw it plus the exact sampled tokens."""

    run_id: str | None  # X-Run-Id; None = not part of a run (stored, never trained)
    group_id: str | None = None  # explicit X-Group-Id (wins over default_group)
    default_group: str | None = None  # used only when the run is new; None: `default_group(...)`
    split: str | None = None  # X-Split: train or val (runs.split); used only when the run is new
    policy: str | None = None  # policy the request named
    adapter: str | None = None  # model the upstream served: base name or policy@step
    policy_step: int | None = None  # 0 = base model
    endpoint: str | None = None  # an `Endpoint`, or a translated API's name
    stream: bool | None = None
    request: dict[str, Any] | None = None  # the client's request body
    response: dict[str, Any] | None = None  # what the client got (a stream assembled)
    prompt_token_ids: list[Any] | None = None
    token_ids: list[Any] | None = None  # one list per choice
    logprobs: list[Any] | None = None  # one list per choice, sampling logprobs
    finish_reason: str | None = None
    status: str | None = None  # ok, error, cancelled
    status_code: int | None = None
    error: str | None = None
    latency_ms: float | None = None
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    created_at: datetime | None = None  # UTC; the writer fills in now() when None
    capture_id: str | None = None  # unique per record (the writer sets it): replays store it once
    # a translated API (Responses, Messages; request/response above hold the chat form the model saw)
    response_id: str | None = None  # the response object's id; None when the client said store: false
    client_request: dict[str, Any] | None = None  # the Responses request body as the client sent it
    client_response: dict[str, Any] | None = None  # the Responses object the client received
    source: str | None = None  # "hosted": a text-only upstream answered (no token ids); None: captured
    key_id: str | None = None  # the app's key (keys.id; proxy/keys.py); None: the shared agents' key


# The record fields that are `completions` columns (group_id/default_group belong to the run).
COMPLETION_FIELDS: tuple[str, ...] = (
    "run_id",
    "policy",
    "adapter",
    "policy_step",
    "endpoint",
    "stream",
    "request",
    "response",
    "prompt_token_ids",
    "token_ids",
    "logprobs",
    "finish_reason",
    "status",
    "status_code",
    "error",
    "latency_ms",
    "ttft_ms",
    "prompt_tokens",
    "completion_tokens",
    "created_at",
    "capture_id",
    "response_id",
    "client_request",
    "client_response",
    "source",
    "key_id",
)


# The record fields stored as JSON, and those stored as 64-bit integer columns.
JSON_FIELDS = (
    "request",
    "response",
    "prompt_token_ids",
    "token_ids",
    "logprobs",
    "client_request",
    "client_response",
)
INT_FIELDS = ("policy_step", "status_code", "prompt_tokens", "completion_tokens")
_INT64 = 1 << 63


def as_count(value: Any) -> int | None:
    """A token count as an integer column can hold it: an int (or an integral float or numeric
    string) within 64 bits, else None (an upstream's garbage is dropped, not stored)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value.strip())
    return value if isinstance(value, int) and -_INT64 <= value < _INT64 else None


def _plain(value: Any) -> Any:
    """`value` as JSON can hold it: strings' lone surrogates replaced, unknown objects as repr."""
    text = json.dumps(value, default=repr, skipkeys=True, ensure_ascii=False)
    return json.loads(text.encode("utf-8", "replace").decode("utf-8"))


def storable(rec: CompletionRecord, reason: str) -> CompletionRecord:
    """A copy of `rec` the store can hold (its JSON fields made plain, its counts integers or
    None, its text fields UTF-8), marked with `reason` in `error`; used when `rec` itself cannot
    be serialized, so that one bad record is kept (as an error) instead of failing its batch."""
    changes: dict[str, Any] = {f: _plain(getattr(rec, f)) for f in JSON_FIELDS}
    changes.update({f: as_count(getattr(rec, f)) for f in INT_FIELDS})
    for f in ("run_id", "group_id", "default_group", "split", "policy", "adapter", "finish_reason", "error"):
        v = getattr(rec, f)
        if v is not None:
            changes[f] = str(v).encode("utf-8", "replace").decode("utf-8")
    if not isinstance(rec.created_at, datetime):
        changes["created_at"] = None  # the writer's now()
    note = f"stored sanitized: {reason}"
    changes["error"] = f"{changes.get('error')}; {note}" if changes.get("error") else note
    return dataclasses.replace(rec, **changes)


def default_group(policy: str | None, body: dict) -> str:
    """A run's group when no X-Group-Id names one: a hash of (policy, tools, messages up to the first
    user message), or of the prompt for completions. The writer takes it from the run's first stored
    completion when it creates the run (`rows.ensure_runs`): once a run, off the serving path."""
    messages = body.get("messages")
    if isinstance(messages, list):
        head = []
        for m in messages:
            head.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
        key = [policy, body.get("tools"), head]
    else:
        key = [policy, None, body.get("prompt")]
    digest = hashlib.sha256(orjson.dumps(key, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"g-{digest[:16]}"
