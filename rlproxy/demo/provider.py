"""A stand-in for a hosted model provider: an OpenAI-compatible endpoint of its own, text only.

There is no network here, so the demo's teacher (and the tests of hosted upstreams) talk to this
server instead of OpenAI. It stands for a hosted model and behaves like one where rlproxy can tell:

- strict about the request: a field OpenAI's chat completions API does not know (vLLM's
  `return_token_ids`, say) is a 400 `Unrecognized request argument supplied: ...`, as OpenAI answers;
- a bearer key is required (401 `invalid_api_key` otherwise);
- answers carry text, tool calls and usage, never token ids; streams are SSE chunks with a usage
  chunk only when `stream_options.include_usage` asks for one, then `data: [DONE]`;
- failures on demand (`fail_next`: a status, its headers; `cut_after`: a stream cut after that many
  chunks), e.g. 429 with `Retry-After` the way a rate-limited provider answers.

What it says is `answer(body) -> message` (a scripted expert: `directory.expert` for the demo), so
the replies are as good as the script. A real provider is one setting away:
`RLPROXY_HOSTED_UPSTREAMS=teacher=https://api.openai.com/v1`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# The request fields of OpenAI's POST /v1/chat/completions (API reference, 2025): anything else is a 400.
CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "metadata",
        "modalities",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)

Answer = Callable[[dict[str, Any]], dict[str, Any]]  # request body -> assistant message


def _error(
    status: int, message: str, type_: str, code: str | None = None, param: str | None = None
) -> Response:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status
    )


def _count(text: str) -> int:
    """A provider's token count, roughly (4 characters a token): usage is reported, never token ids."""
    return max(1, len(text) // 4)


class Provider:
    """The stand-in provider's state: its script, key, model name, failure knobs and what it was sent."""

    def __init__(
        self, answer: Answer, api_key: str = "sk-hosted-stand-in", model: str = "hosted-expert"
    ) -> None:
        self.answer = answer
        self.api_key = api_key
        self.model = model
        self.requests: list[dict[str, Any]] = []  # every body received, as received
        self.headers: list[dict[str, str]] = []  # the headers of each
        self.fail_next: list[tuple[int, dict[str, str]]] = []  # answered before anything else, in order
        self.cut_after: int | None = None  # a stream is cut after this many chunks (once)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return _error(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "We could not parse the JSON body of your request.", "invalid_request_error")
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.fail_next:
            status, headers = self.fail_next.pop(0)
            kind = {429: "requests", 401: "invalid_request_error"}.get(status, "server_error")
            resp = _error(status, f"stand-in provider: answered {status} on purpose", kind)
            resp.headers.update(headers)
            return resp
        unknown = sorted(set(body) - CHAT_FIELDS)
        if unknown:
            return _error(
                400, f"Unrecognized request argument supplied: {', '.join(unknown)}", "invalid_request_error"
            )
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "'messages' is a required property", "invalid_request_error", param="messages")
        message = self.answer(body)
        prompt_tokens = _count(json.dumps(body["messages"]))
        completion_tokens = _count(json.dumps(message))
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if body.get("stream") is True:
            with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                self._chunks(cid, created, message, finish, usage if with_usage else None),
                media_type="text/event-stream",
            )
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": usage,
            }
        )

    async def _chunks(
        self, cid: str, created: int, message: dict[str, Any], finish: str, usage: dict[str, int] | None
    ) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> bytes:
            obj = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                **extra,
            }
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        parts = [chunk({"role": "assistant", "content": ""})]
        text = message.get("content") or ""
        parts += [chunk({"content": text[i : i + 8]}) for i in range(0, len(text), 8)]
        for i, call in enumerate(message.get("tool_calls") or ()):
            args = call["function"]["arguments"]
            head = {
                "index": i,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            parts.append(chunk({"tool_calls": [head]}))
            parts += [
                chunk({"tool_calls": [{"index": i, "function": {"arguments": args[j : j + 10]}}]})
                for j in range(0, len(args), 10)
            ]
        parts.append(chunk({}, finish))
        if usage is not None:
            parts.append(
                b"data: "
                + json.dumps(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.model,
                        "choices": [],
                        "usage": usage,
                    }
                ).encode()
                + b"\n\n"
            )
        parts.append(b"data: [DONE]\n\n")
        cut, self.cut_after = self.cut_after, None
        for n, part in enumerate(parts):
            if cut is not None and n >= cut:
                raise ConnectionAbortedError("stand-in provider: stream cut on purpose")
            yield part
            await asyncio.sleep(0)


class Served(Protocol):
    """Anything with a Starlette app (the stand-in provider, the demo's scorer)."""

    app: Starlette


class ProviderServer:
    """`provider` (any `Served`) under uvicorn on a loopback port, in a thread of its own: `start()`,
    `.url`, `stop()`."""

    def __init__(self, provider: Served, port: int = 0) -> None:
        self.provider = provider
        self.port = port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL to give an OpenAI client (or `hosted_upstreams`): ends with /v1."""
        return f"{self.root}/v1"

    @property
    def root(self) -> str:
        """http://127.0.0.1:PORT, no path."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProviderServer:
        import socket

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.provider.app, log_level="error", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            daemon=True,
            name=f"{type(self.provider).__name__}-server",
        )
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                return self
            time.sleep(0.01)
        raise RuntimeError("the stand-in provider did not start")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
