"""Fake upstreams of the proxy's wire tests (test_messages, test_responses, test_messages_agent_sdk):
vLLM-shaped tool calls, written as a chat stream by hand."""

from __future__ import annotations

import asyncio
import time

import orjson
from stub_upstream import StubUpstream


def write_sse(w: asyncio.StreamWriter, events: list[dict]) -> None:
    """A whole chunked `text/event-stream` answer: each event as `data: <json>`, then `data: [DONE]`."""
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for e in [*events, None]:
        data = b"data: [DONE]\n\n" if e is None else b"data: " + orjson.dumps(e) + b"\n\n"
        w.write(b"%x\r\n%s\r\n" % (len(data), data))
    w.write(b"0\r\n\r\n")


class ToolStub(StubUpstream):
    """Answers every chat request with a text prefix and one get_weather call (vLLM's shapes); keeps
    the bodies it got. With `usage`, a stream ends with a usage chunk (vLLM's `include_usage`)."""

    CALL = {
        "id": "chatcmpl-tool-abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }

    def __init__(self, usage: bool = True) -> None:
        super().__init__()
        self.bodies: list[dict] = []
        self.usage = usage

    def _full(self, req: dict, chat: bool) -> dict:
        self.bodies.append(req)
        out = super()._full(req, chat)
        choice = out["choices"][0]
        choice["message"] = {"role": "assistant", "content": "Checking.", "tool_calls": [self.CALL]}
        choice["finish_reason"] = "tool_calls"
        return out

    async def _stream(self, req: dict, chat: bool, delay: float, w: asyncio.StreamWriter) -> None:
        self.bodies.append(req)
        head = {
            "id": "chatcmpl-s",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req["model"],
        }
        ids = bool(req.get("return_token_ids"))
        lp = {"content": [{"token": "x", "logprob": -0.25, "bytes": None, "top_logprobs": []}]}

        def chunk(delta: dict, tok: int, finish: str | None = None) -> dict:
            c = {
                "index": 0,
                "delta": delta,
                "logprobs": lp if req.get("logprobs") else None,
                "finish_reason": finish,
            }
            c["token_ids"] = [tok] if ids else None
            return {**head, "choices": [c]}

        first = {
            **head,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
        first["prompt_token_ids"] = [1, 2, 3] if ids else None
        fn = self.CALL["function"]
        call = {
            "index": 0,
            "id": self.CALL["id"],
            "type": "function",
            "function": {"name": fn["name"], "arguments": ""},
        }
        events = [
            first,
            chunk({"content": "Checking."}, 10),
            chunk({"tool_calls": [call]}, 11),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, 12),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, 13),
            chunk({}, 14, "tool_calls"),
        ]
        if self.usage:
            usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
            events.append({**head, "choices": [], "usage": usage})
        write_sse(w, events)


class BreakingStub(StubUpstream):
    """Streams two chat chunks, then drops the connection (an upstream that died mid-answer)."""

    async def _stream(self, req: dict, chat: bool, delay: float, w: asyncio.StreamWriter) -> None:
        head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": req["model"]}
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for text in ("Hel", "lo"):
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
            choice["token_ids"] = [7] if req.get("return_token_ids") else None
            data = b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"
            w.write(b"%x\r\n%s\r\n" % (len(data), data))
        await w.drain()
        w.close()
