"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API, served by the proxy
over the upstream's chat completions, like `/v1/responses` (`proxy/responses.py`).

The route is a hot route (`routes_openai.complete`): the Messages body is translated
(`wire/messages.py`) into the chat body the model sees, which takes the chat path unchanged (policy
routing, injected `return_token_ids`/`logprobs`, capture, store), and the chat answer is translated
back: a `message` object, or (streamed) Messages SSE events made from the chat chunks as they arrive.
Stored like a Responses call (migration 0003): `request`/`response` hold the chat form,
`client_request`/`client_response` what the client sent and got; endpoint `messages`.

Agent CLIs (Claude Code) ask for `max_tokens: 32000` whatever the model's context: when the
upstream refuses a request because prompt + `max_tokens` pass the context length, it is sent again
without `max_tokens` (chat completions then stop where the context is full: the ceiling clamped to
what the context leaves), and that is the request stored. A hosted policy's call is never sent
again (nor to another upstream): the provider's refusal is the answer (proxy/hosted.py). The
query string (`?beta=true`) is not forwarded; `anthropic-beta` / `anthropic-version` headers are
accepted (the upstream ignores them).

`count_tokens` is served over the upstream's `POST /tokenize` (vLLM's, and the embedded engine's):
the prompt of the translated chat body, counted by the model's own chat template; a hosted
policy's by its provider's `/tokenize` (a provider without one: 502, as documented).

Errors on these routes are in Anthropic's shape (`error`, which `apis.ErrorShapes`, outermost in the
ASGI stack, applies: so the guard's 401/403/415, the limits' 413/503 and the routes' 400/404/502 all
get it), with 422 as 400.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import orjson
from starlette.responses import Response

from rlproxy.errors import APIError
from rlproxy.proxy import forward, validate
from rlproxy.proxy.stream import EventStream
from rlproxy.wire.message_events import MessageEvents, count_object, message_object, new_message_id
from rlproxy.wire.messages import MessagesInputError, chat_request, count_request, error_body, error_status

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Call:
    """One Messages call on its way through the chat path (the interface of `responses.Call`)."""

    body: dict  # the client's Messages body
    chat: dict  # the chat-completions body made from it (forwarded and stored as `request`)
    run_id: None = None  # a Messages call has no chain to inherit a run from
    response_id: str = field(default_factory=new_message_id)
    created_at: int = field(default_factory=lambda: int(time.time()))
    store: bool = False  # a message id names no stored continuation (no `response_id` column value)

    def answer(self, chat: dict) -> dict:
        """The client's `message` object for the chat completion `chat`."""
        return message_object(chat, message_id=self.response_id, model=self.body.get("model"))

    def events(self, model: str) -> EventStream:
        """Chat chunks in, Messages SSE events out (message_start waits for the first chunk: its
        prompt token ids give input_tokens)."""
        return EventStream(MessageEvents(message_id=self.response_id, model=model))


async def prepare(px, scope, body: dict) -> Call:
    """Translate `body` (400 naming the field for what cannot be served)."""
    try:
        return Call(body=body, chat=chat_request(body))
    except MessagesInputError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


async def side(px, request, path: str) -> Response | None:
    """`POST /v1/messages/count_tokens`; None for any other path below /v1/messages (relayed)."""
    if request.method != "POST" or path.rstrip("/") != "messages/count_tokens":
        return None
    body = validate.parse_body(await request.body(), px.settings.max_json_depth)
    headers = forward.request_headers(list(request.scope["headers"]), px.drop_headers, identity=True)
    return await count_tokens(px, body, headers)


async def count_tokens(px, body: dict, headers: list) -> Response:
    """`POST /v1/messages/count_tokens`: `{"input_tokens": N}`, counted by the upstream's `/tokenize`."""
    try:
        chat = count_request(body)
    except MessagesInputError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    policy, _, model = px.policies.resolve(chat.get("model"))
    # a hosted policy's prompt is counted by its provider (or not at all: the 502 below), never by
    # the engine, whose tokenizer is not the provider's
    upstream = (px.hosted.get(policy) if px.hosted else None) or px.upstream
    tokenize = {"model": model, "messages": chat["messages"], "add_generation_prompt": True}
    if chat.get("tools"):
        tokenize["tools"] = chat["tools"]
    resp = await upstream.post(b"/tokenize", headers, orjson.dumps(tokenize), b"", False)
    content = resp.content
    if resp.status_code != 200:
        said = content.decode("utf-8", "replace")[:500] if resp.status_code < 500 else "(logged)"
        if resp.status_code >= 500:  # a traceback or paths, maybe: the log's, not the client's
            logger.warning("POST /tokenize answered %d: %s", resp.status_code, content[:2000])
        raise APIError(
            502 if resp.status_code >= 500 or resp.status_code == 404 else resp.status_code,
            f"the upstream could not count tokens (POST /tokenize answered {resp.status_code}): {said}",
        )
    return Response(orjson.dumps(count_object(orjson.loads(content))), media_type="application/json")


def _message_of(body: bytes) -> str:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")[:2000] or "error"
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(parsed.get("detail"), str):
            return parsed["detail"]
    return body.decode("utf-8", "replace")[:2000]


def error(status: int, body: bytes) -> tuple[int, bytes]:
    """An error answer in Anthropic's shape `{"type": "error", "error": {"type", "message"}}`, 422
    as 400 (`apis.ErrorShapes` calls it on these routes)."""
    status = error_status(status)
    return status, orjson.dumps(error_body(status, _message_of(body)))
