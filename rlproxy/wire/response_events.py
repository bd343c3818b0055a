"""The Responses API's answer side: a chat completion becomes a `response` object
(`response_object`), a stream of chat chunks a stream of Responses SSE events (`ResponseEvents`).

Both build the same items (`_message_item`, `_call_item`, ...), so a streamed answer's final
`response` is the one `response_object` makes. Pure, no I/O; everything emitted parses with the
`openai` package's `Response` / `ResponseStreamEvent`. The request side is `wire/responses.py`
(as `wire/message_events.py` is beside `wire/messages.py`).
"""

from __future__ import annotations

import os
from typing import Any

from rlproxy.wire.responses import LOGPROBS_INCLUDE

# ---------------------------------------------------------------------------------------------
# Response


def _new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"  # uuid4().hex without building a UUID


def _want_logprobs(body: dict) -> bool:
    return LOGPROBS_INCLUDE in (body.get("include") or []) or bool(body.get("top_logprobs"))


def _logprob(entry: dict) -> dict:
    """A chat logprob entry -> a Responses output_text logprob."""
    return {
        "token": entry.get("token", ""),
        "logprob": entry.get("logprob"),
        "bytes": entry.get("bytes") or list(entry.get("token", "").encode()),
        "top_logprobs": [
            {"token": t.get("token", ""), "logprob": t.get("logprob"), "bytes": t.get("bytes") or []}
            for t in entry.get("top_logprobs") or ()
        ],
    }


def _message_item(item_id: str, text: str, logprobs: list, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def _reasoning_item(item_id: str, text: str, status: str | None) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(usage: dict | None) -> dict | None:
    if not usage:
        return None
    inp = usage.get("prompt_tokens") or 0
    out = usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens") or inp + out,
    }


def _shell(body: dict, *, response_id: str, created_at: int, model: str, status: str) -> dict:
    """The response object without output: the request's parameters echoed like OpenAI and vLLM."""
    tools = body.get("tools") or []
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto",
        "store": body.get("store", True) is not False,
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": tools,
        "top_logprobs": body.get("top_logprobs") or 0,
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "truncation": body.get("truncation") or "disabled",
        "usage": None,
        "user": body.get("user"),
    }


def _finish(response: dict, finish_reason: str | None) -> None:
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def response_object(body: dict, chat: dict, *, response_id: str, created_at: int) -> dict:
    """Non-streamed: a chat completion (dict) -> the Responses `response` object (see the module doc)."""
    response = _shell(
        body,
        response_id=response_id,
        created_at=created_at,
        model=chat.get("model") or body.get("model") or "",
        status="completed",
    )
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        response["output"].append(_reasoning_item(_new_id("rs"), reasoning, None))
    if message.get("content"):
        entries = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [_logprob(e) for e in entries] if _want_logprobs(body) else []
        response["output"].append(_message_item(_new_id("msg"), message["content"], logprobs, "completed"))
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        response["output"].append(
            _call_item(
                _new_id("fc"),
                call.get("id") or _new_id("call"),
                fn.get("name") or "",
                fn.get("arguments") or "",
                "completed",
            )
        )
    response["usage"] = _usage(chat.get("usage"))
    _finish(response, choice.get("finish_reason"))
    return response


class ResponseEvents:
    """Streamed: chat-completion chunk dicts in, Responses SSE event dicts out.

    `start()` gives response.created and response.in_progress; `feed(chunk)` the events a chunk
    makes (an output item is opened at its first delta and closed when another kind begins);
    `finish()` closes the open item and ends with response.completed, or response.incomplete when
    the model hit `max_output_tokens`; `fail(message)` ends a broken stream with response.failed.
    Only choice 0 is read (a Responses call has one answer)."""

    def __init__(self, body: dict, *, response_id: str, created_at: int, model: str) -> None:
        self.body = body
        self._response = _shell(
            body, response_id=response_id, created_at=created_at, model=model, status="in_progress"
        )
        self._seq = 0
        self._want_logprobs = _want_logprobs(body)
        self._open: dict | None = None  # the item being streamed (its final form is built on close)
        self._kind: str | None = None  # message | reasoning | function_call
        self._tool_index: int | None = None
        self._text: list[str] = []
        self._logprobs: list[dict] = []
        self._finish_reason: str | None = None
        self._usage: dict | None = None

    # -- events --------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict:
        return {**self._response, "output": list(self._response["output"])}

    @property
    def response(self) -> dict:
        """The response object as it stands (the final one once `finish` ran)."""
        return self._response

    def start(self) -> list[dict]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def _index(self) -> int:
        return len(self._response["output"])

    def _open_item(self, kind: str, item: dict) -> list[dict]:
        self._kind, self._open, self._text, self._logprobs = kind, item, [], []
        events = [self._event("response.output_item.added", output_index=self._index(), item=dict(item))]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._part_event("response.content_part.added", part))
        elif kind == "reasoning":
            events.append(
                self._part_event("response.content_part.added", {"type": "reasoning_text", "text": ""})
            )
        return events

    def _item_event(self, kind: str, **fields: Any) -> dict:
        """An event of the open item: its id and output index, then `fields`."""
        return self._event(kind, item_id=self._open["id"], output_index=self._index(), **fields)

    def _part_event(self, kind: str, part: dict) -> dict:
        return self._item_event(kind, content_index=0, part=part)

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        item, text, index = self._open, "".join(self._text), self._index()
        events: list[dict] = []
        if self._kind in ("message", "reasoning"):  # a text part: its text done, then the part
            if self._kind == "message":
                final = _message_item(item["id"], text, self._logprobs, "completed")
                done, extra = "response.output_text.done", {"logprobs": self._logprobs}
            else:
                final = _reasoning_item(item["id"], text, "completed")
                done, extra = "response.reasoning_text.done", {}
            fields = {"item_id": item["id"], "output_index": index, "content_index": 0, "text": text}
            events.append(self._event(done, **fields, **extra))
            events.append(self._part_event("response.content_part.done", final["content"][0]))
        else:
            final = _call_item(item["id"], item["call_id"], item["name"], text, "completed")
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=final))
        self._response["output"].append(final)
        self._open = self._kind = self._tool_index = None
        return events

    # -- chunks --------------------------------------------------------------------------------
    def feed(self, chunk: dict) -> list[dict]:
        """The events one parsed chat chunk makes (none for a chunk without news)."""
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[dict] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                if self._kind != "reasoning":
                    events += self._close()
                    events += self._open_item("reasoning", _reasoning_item(_new_id("rs"), "", "in_progress"))
                self._text.append(reasoning)
                events.append(
                    self._item_event("response.reasoning_text.delta", content_index=0, delta=reasoning)
                )
            if delta.get("content"):
                if self._kind != "message":
                    events += self._close()
                    item = _message_item(_new_id("msg"), "", [], "in_progress")
                    item["content"] = []
                    events += self._open_item("message", item)
                entries = (choice.get("logprobs") or {}).get("content") or []
                logprobs = [_logprob(e) for e in entries] if self._want_logprobs else []
                self._logprobs.extend(logprobs)
                self._text.append(delta["content"])
                events.append(
                    self._item_event(
                        "response.output_text.delta",
                        content_index=0,
                        delta=delta["content"],
                        logprobs=logprobs,
                    )
                )
            for call in delta.get("tool_calls") or ():
                events += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def _tool_delta(self, call: dict) -> list[dict]:
        events: list[dict] = []
        fn = call.get("function") or {}
        index = call.get("index", 0)
        if self._kind != "function_call" or self._tool_index != index:
            events += self._close()
            item = _call_item(
                _new_id("fc"), call.get("id") or _new_id("call"), fn.get("name") or "", "", "in_progress"
            )
            events += self._open_item("function_call", item)
            self._tool_index = index
        elif fn.get("name"):  # a name in pieces (not sent by vLLM's parsers, but legal)
            self._open["name"] += fn["name"]
        if fn.get("arguments"):
            self._text.append(fn["arguments"])
            events.append(self._item_event("response.function_call_arguments.delta", delta=fn["arguments"]))
        return events

    def finish(self) -> list[dict]:
        """Close the open item; response.completed (or response.incomplete at the token limit)."""
        events = self._close()
        self._response["usage"] = _usage(self._usage)
        _finish(self._response, self._finish_reason)
        kind = "response.incomplete" if self._response["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=self._snapshot()))
        return events

    def fail(self, message: str) -> list[dict]:
        """End a stream the upstream broke: response.failed with the reason (no item is closed)."""
        self._response["status"] = "failed"
        self._response["error"] = {"code": "server_error", "message": message}
        self._response["usage"] = _usage(self._usage)
        return [self._event("response.failed", response=self._snapshot())]
