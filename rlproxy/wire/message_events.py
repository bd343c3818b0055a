"""Anthropic's Messages API, the answer side: chat completions -> `message` objects and stream events.
Pure functions, no I/O (the request side and the mapping are described in `wire/messages.py`).

    message_object(chat, message_id=)    chat completion -> `message` object
    MessageEvents(message_id=, model=)   chat chunks -> Messages SSE events (feed, finish, fail)
    count_object(tokenized)              the upstream's `/tokenize` answer -> count_tokens' answer

`stop_reason` is `max_tokens` for a length finish, `tool_use` when tool calls were made,
`stop_sequence` (with `stop_sequence` set) when the upstream names the matched stop string (vLLM's
and the engine's `stop_reason`), else `end_turn`. `usage.input_tokens` excludes cached prompt
tokens (given as `cache_read_input_tokens` when the upstream reports them).
"""

from __future__ import annotations

import json
import os
from typing import Any

from rlproxy.wire.messages import error_body


def new_message_id() -> str:
    return f"msg_{os.urandom(16).hex()}"  # uuid4().hex without building a UUID


def _usage(usage: dict | None, prompt_tokens: int | None = None) -> dict:
    usage = usage or {}
    inp = usage.get("prompt_tokens")
    if inp is None:
        inp = prompt_tokens or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": max(0, inp - cached),
        "output_tokens": usage.get("completion_tokens") or 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def stop_reason(finish_reason: str | None, matched: Any, tool_used: bool) -> tuple[str | None, str | None]:
    """(Anthropic stop_reason, stop_sequence) from the chat finish reason and the upstream's
    `stop_reason` (the matched stop string, a stop token id, or None)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason is None or finish_reason == "error":
        return None, None
    if tool_used or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _input(arguments: str | None) -> dict:
    """A tool call's arguments as the `input` object (a call whose arguments are not a JSON object
    keeps them under `_arguments`, so nothing the model wrote is lost)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"_arguments": arguments}
    return value if isinstance(value, dict) else {"_arguments": arguments}


def _shell(message_id: str, model: str) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(None),
    }


def message_object(chat: dict, *, message_id: str, model: str | None = None) -> dict:
    """Non-streamed: a chat completion (dict) -> the Messages `message` object (see the module doc)."""
    message = _shell(message_id, chat.get("model") or model or "")
    choice = (chat.get("choices") or [{}])[0]
    chat_msg = choice.get("message") or {}
    reasoning = chat_msg.get("reasoning_content") or chat_msg.get("reasoning")
    if reasoning:
        message["content"].append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if chat_msg.get("content"):
        message["content"].append({"type": "text", "text": chat_msg["content"]})
    calls = chat_msg.get("tool_calls") or []
    for call in calls:
        fn = call.get("function") or {}
        message["content"].append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{os.urandom(16).hex()}",
                "name": fn.get("name") or "",
                "input": _input(fn.get("arguments")),
            }
        )
    if not message["content"]:  # Anthropic's empty answer is one empty text block
        message["content"].append({"type": "text", "text": ""})
    message["stop_reason"], message["stop_sequence"] = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), bool(calls)
    )
    message["usage"] = _usage(chat.get("usage"), len(chat.get("prompt_token_ids") or ()) or None)
    return message


def count_object(tokenized: dict) -> dict:
    """The upstream's `/tokenize` answer -> the count_tokens answer."""
    return {"input_tokens": int(tokenized.get("count") or len(tokenized.get("tokens") or ()))}


class MessageEvents:
    """Streamed: chat-completion chunk dicts in, Messages SSE event dicts out.

    message_start (and a ping) comes with the first chunk, whose `prompt_token_ids` (when the
    upstream gives them) make its `usage.input_tokens`; a content block is opened at its first
    delta and closed (content_block_stop) when another kind or another tool call begins; `finish()`
    closes the open block and ends with message_delta (stop_reason, usage) and message_stop;
    `fail(message)` ends a broken stream with an `error` event. Only choice 0 is read."""

    def __init__(self, *, message_id: str, model: str) -> None:
        self._message = _shell(message_id, model)
        self._started = False
        self._kind: str | None = None  # text | tool_use | thinking: the open block
        self._tool_index: int | None = None
        self._parts: list[str] = []
        self._open: dict | None = None
        self._finish_reason: str | None = None
        self._matched: Any = None
        self._tool_used = False
        self._usage: dict | None = None
        self._prompt_tokens: int | None = None

    @property
    def response(self) -> dict:
        """The message as it stands (the final one once `finish` ran)."""
        return self._message

    def start(self) -> list[dict]:
        return []  # message_start waits for the first chunk (its prompt token ids give input_tokens)

    def _start(self) -> list[dict]:
        if self._started:
            return []
        self._started = True
        shell = {**self._message, "content": [], "usage": _usage(None, self._prompt_tokens)}
        self._message["usage"] = shell["usage"]
        return [{"type": "message_start", "message": shell}, {"type": "ping"}]

    def _index(self) -> int:
        return len(self._message["content"])

    def _open_block(self, kind: str, block: dict) -> list[dict]:
        events = self._close()
        self._kind, self._open, self._parts = kind, block, []
        events.append({"type": "content_block_start", "index": self._index(), "content_block": dict(block)})
        return events

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        block, text, index = self._open, "".join(self._parts), self._index()
        events = []
        if self._kind == "text":
            block["text"] = text
        elif self._kind == "thinking":
            block["thinking"] = text
            events.append(
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "signature_delta", "signature": ""},
                }
            )
        else:
            block["input"] = _input(text)
        events.append({"type": "content_block_stop", "index": index})
        self._message["content"].append(block)
        self._open = self._kind = self._tool_index = None
        return events

    def feed(self, chunk: dict) -> list[dict]:
        """The events one parsed chat chunk makes (none for a chunk without news)."""
        if isinstance(chunk.get("prompt_token_ids"), list):
            self._prompt_tokens = len(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events = self._start()
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                if self._kind != "thinking":
                    events += self._open_block(
                        "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                    )
                self._parts.append(reasoning)
                events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            if delta.get("content"):
                if self._kind != "text":
                    events += self._open_block("text", {"type": "text", "text": ""})
                self._parts.append(delta["content"])
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                events += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
                self._matched = choice.get("stop_reason")
        return events

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self._index(), "delta": delta}

    def _tool_delta(self, call: dict) -> list[dict]:
        events: list[dict] = []
        fn = call.get("function") or {}
        index = call.get("index", 0)
        if self._kind != "tool_use" or self._tool_index != index:
            block = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{os.urandom(16).hex()}",
                "name": fn.get("name") or "",
                "input": {},
            }
            events += self._open_block("tool_use", block)
            self._tool_index = index
            self._tool_used = True
        elif fn.get("name"):  # a name in pieces (legal in chat chunks)
            self._open["name"] += fn["name"]
        if fn.get("arguments"):
            self._parts.append(fn["arguments"])
            events.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events

    def finish(self) -> list[dict]:
        """Close the open block; message_delta (stop_reason, usage) and message_stop."""
        events = self._start() + self._close()
        reason, sequence = stop_reason(self._finish_reason or "stop", self._matched, self._tool_used)
        usage = _usage(self._usage, self._prompt_tokens)
        self._message.update(stop_reason=reason, stop_sequence=sequence, usage=usage)
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage,
            }
        )
        events.append({"type": "message_stop"})
        return events

    def fail(self, message: str) -> list[dict]:
        """End a stream the upstream broke: an `error` event (no block is closed)."""
        return [error_body(500, message)]
