"""OpenAI chat JSONL -> model calls: the fine-tuning format and stored-completions exports.

- `{"messages": [...], "tools": [...]?}` (the fine-tuning format): its last message is the reply
  (an assistant turn), the rest the request; the run's id is a hash of the line's content, so the
  same example imported twice is stored once.
- a `chat.completion` object (`"object": "chat.completion"`, as `GET /v1/chat/completions/{id}`
  returns a stored completion) with its request under `request` (or its messages under `messages`
  / `input_messages`, as `GET /v1/chat/completions/{id}/messages` lists them), and a
  `{"request": {...}, "response": {...}}` pair: one call, its run keyed by the completion's `id`.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from rlproxy.traces.readers import Malformed, Read, chat_call, timestamp

_REQUEST_KEYS = ("model", "messages", "tools")


def read_chat(record: dict[str, Any]) -> Read:
    """One line of OpenAI chat JSONL (either shape above) as its call."""
    if "response" in record and isinstance(record.get("request"), dict):
        return _completion(record["response"], record["request"])
    if record.get("object") == "chat.completion" or "choices" in record:
        request = record.get("request")
        if not isinstance(request, dict):
            messages = record.get("messages", record.get("input_messages"))
            request = {"model": record.get("model"), "messages": _listed(messages)}
        return _completion(record, request)
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Malformed('no "messages" list (OpenAI chat JSONL) and no "choices" (a chat.completion)')
    *context, reply = messages
    if not isinstance(reply, dict) or reply.get("role") != "assistant":
        raise Malformed("the last message is not the assistant's reply")
    key = hashlib.sha256(orjson.dumps(record, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]
    reply = {k: v for k, v in reply.items() if k != "weight"}  # the fine-tuning format's per-turn weight
    call = chat_call(
        trace_id=key,
        span_id="0",
        model=record.get("model"),
        messages=context,
        reply=reply,
        tools=record.get("tools"),
    )
    return Read(calls=[call])


def _listed(messages: Any) -> Any:
    """Messages as a list: the /messages endpoint's page (`{"data": [...]}`) unwrapped."""
    return messages.get("data") if isinstance(messages, dict) else messages


def _completion(response: Any, request: dict[str, Any]) -> Read:
    if (
        not isinstance(response, dict)
        or not isinstance(response.get("choices"), list)
        or not response["choices"]
    ):
        raise Malformed("a chat.completion without choices")
    choice = response["choices"][0]
    cid = str(
        response.get("id")
        or hashlib.sha256(orjson.dumps(response, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]
    )
    usage = response.get("usage") or {}
    started = timestamp(response.get("created"))
    call = chat_call(
        trace_id=cid,
        span_id=cid,
        model=request.get("model") or response.get("model"),
        messages=_listed(request.get("messages")),
        reply=dict(choice.get("message") or {}),
        tools=request.get("tools"),
        params={k: v for k, v in request.items() if k not in _REQUEST_KEYS},
        finish_reason=choice.get("finish_reason"),
        usage=(usage.get("prompt_tokens"), usage.get("completion_tokens")),
        started=started,
        response_id=cid,
    )
    return Read(calls=[call])
