"""Server-sent-event encoders: one event dict (or chat chunk) -> the bytes or text of one SSE event."""

from __future__ import annotations

import json
from typing import Any

import orjson


def event_bytes(event: dict) -> bytes:
    """`event: <type>` + `data: <json>` (a typed event: Responses, Messages), as bytes (the proxy)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def event_text(event: dict[str, Any]) -> str:
    """The same as text (the embedded engine's StreamingResponse)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def data_text(obj: dict[str, Any]) -> str:
    """`data: <json>` (an untyped chunk: chat and text completions), as text."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
