"""What the embedded engine's routes answer with (`server.py`): the chat and completions bodies and
their chunk streams, the Responses and Messages event streams made over the chat chunks, and the
store of earlier responses (`previous_response_id`, `GET /v1/responses/{id}`).

Each takes a finished or running `Generation` and shapes it as vLLM 0.32 does; nothing here runs
model code or reads a request.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from rlproxy.errors import APIError
from rlproxy.inference.generation import Choice, Generation, chat_logprobs, completion_logprobs
from rlproxy.inference.protocol import ChatBody, CompletionBody
from rlproxy.inference.tools import ToolStream, parse_tool_calls
from rlproxy.wire.message_events import MessageEvents
from rlproxy.wire.response_events import ResponseEvents
from rlproxy.wire.responses import conversation


def _sse(obj: dict[str, Any]) -> str:
    """`data: <json>` (an untyped chunk: chat and text completions)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _event(event: dict[str, Any]) -> str:
    """`event: <type>` + `data: <json>` (a typed event: Responses, Messages)."""
    return f"event: {event['type']}\n{_sse(event)}"


# ---------------------------------------------------------------------------------------------
# Chat completions: one body, or chunks


def chat_result(tok: Any, gen: Generation, body: ChatBody, results: list[Choice]) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(results):
        content: str | None = c.text
        calls: list[dict[str, Any]] = []
        if body.parse_tools:
            content, calls = parse_tool_calls(c.text)
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": content, "tool_calls": calls},
            "logprobs": chat_logprobs(tok, c.logprobs) if body.logprobs else None,
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    resp: dict[str, Any] = {"object": "chat.completion", "choices": choices, "usage": gen.usage()}
    if body.return_token_ids:
        resp["prompt_token_ids"] = gen.prompt_ids(0)
    return resp


async def chat_stream(tok: Any, gen: Generation, body: ChatBody, meta: dict[str, Any]) -> AsyncIterator[str]:
    async for chunk in chat_chunks(tok, gen, body, meta):
        yield _sse(chunk)
    yield "data: [DONE]\n\n"


async def chat_chunks(
    tok: Any, gen: Generation, body: ChatBody, meta: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    base = {**meta, "object": "chat.completion.chunk"}
    tools = [ToolStream() for _ in gen.choices] if body.parse_tools else None
    async with gen:
        for i in range(len(gen.choices)):
            first = {
                **base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if body.return_token_ids:
                first["prompt_token_ids"] = gen.prompt_ids(i)
            yield first
        async for i, d in gen.deltas():
            text, delta = d.text, {}
            finish = d.finish_reason
            if tools is not None:
                text = tools[i].feed(d.text)
                if finish is not None:
                    rest, calls = tools[i].finish()
                    text += rest
                    if calls:
                        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                        finish = "tool_calls" if finish == "stop" else finish
            if text:
                delta["content"] = text
            if not delta and finish is None and not d.logprobs and not body.return_token_ids:
                continue
            choice: dict[str, Any] = {
                "index": i,
                "delta": delta,
                "logprobs": chat_logprobs(tok, d.logprobs) if body.logprobs else None,
                "finish_reason": finish,
            }
            if finish is not None:
                choice["stop_reason"] = d.stop_reason
            if body.return_token_ids:
                choice["token_ids"] = d.token_ids
            yield {**base, "choices": [choice]}
        if body.include_usage:
            yield {**base, "choices": [], "usage": gen.usage()}


# ---------------------------------------------------------------------------------------------
# Completions: one body, or chunks


def completion_result(
    tok: Any, gen: Generation, body: CompletionBody, results: list[Choice]
) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(results):
        choice: dict[str, Any] = {
            "index": i,
            "text": c.text,
            "logprobs": completion_logprobs(tok, c.logprobs) if body.logprobs is not None else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if body.return_token_ids:
            choice["prompt_token_ids"] = gen.prompt_ids(i)
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    return {"object": "text_completion", "choices": choices, "usage": gen.usage()}


async def completion_stream(
    tok: Any, gen: Generation, body: CompletionBody, meta: dict[str, Any]
) -> AsyncIterator[str]:
    base = {**meta, "object": "text_completion"}
    started: set[int] = set()
    offsets = [0] * len(gen.choices)
    async with gen:
        async for i, d in gen.deltas():
            if not d.text and d.finish_reason is None and not d.logprobs and not body.return_token_ids:
                continue
            choice: dict[str, Any] = {
                "index": i,
                "text": d.text,
                "logprobs": None,
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
            }
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(tok, d.logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in choice["logprobs"]["tokens"])
            if body.return_token_ids:
                if i not in started:
                    choice["prompt_token_ids"] = gen.prompt_ids(i)
                choice["token_ids"] = d.token_ids
            started.add(i)
            yield _sse({**base, "choices": [choice]})
        if body.include_usage:
            yield _sse({**base, "choices": [], "usage": gen.usage()})
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# Responses and Messages: events over the chat chunks, and the store of earlier responses


async def event_stream(
    tok: Any,
    gen: Generation,
    body: ChatBody,
    meta: dict[str, Any],
    events: ResponseEvents | MessageEvents,
    store: ResponseStore | None = None,
) -> AsyncIterator[str]:
    """Responses or Messages SSE from the chat chunks (`events`: the wire/ translator), ended by its
    `fail` if the engine failed; a Responses answer is kept in `store` at the end."""
    message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": []}
    failed = False
    for event in events.start():
        yield _event(event)
    async for chunk in chat_chunks(tok, gen, body, meta):
        for choice in chunk["choices"]:
            message["content"] += choice["delta"].get("content") or ""
            message["tool_calls"] += choice["delta"].get("tool_calls") or []
            failed = failed or choice["finish_reason"] == "error"
        for event in events.feed(chunk):
            yield _event(event)
    for event in (
        events.fail("the engine failed while generating; see its log") if failed else events.finish()
    ):
        yield _event(event)
    if store is not None and not failed:
        store.put(events.response, conversation({"messages": body.messages}, message))


class ResponseStore:
    """The newest `size` responses by id, each with the chat messages a continuation starts from."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._kept[response["id"]] = (response, messages)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any]:
        """The response; APIError 404 (vLLM's answer) when unknown or evicted."""
        if response_id not in self._kept:
            raise APIError(
                404,
                f"Response with id '{response_id}' not found.",
                type="invalid_request_error",
                param="response_id",
            )
        return self._kept[response_id][0]

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """The messages `previous_response_id` continues from; 404 like `get`."""
        self.get(response_id)
        return self._kept[response_id][1]
