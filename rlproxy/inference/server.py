"""The embedded engine's OpenAI-compatible HTTP app, mirroring vLLM 0.32's routes, bodies and errors.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health
    POST /v1/responses   GET /v1/responses/{response_id}
    POST /v1/messages   POST /v1/messages/count_tokens   POST /tokenize
    POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}
    POST /v1/unload_lora_adapter {lora_name}

The routes are the plain handlers on `router` below; each reads its engine from `request.app.state`,
so one router serves any number of engines. `create_engine_app` only assembles the app.

With `api_key` set, every route but `/health` needs `Authorization: Bearer <api_key>` and answers
401 `{"error": "Unauthorized"}` (vLLM's `--api-key` answer) without it: the proxy's engine is reached
only with the per-process secret the composition root made.

Errors use vLLM's body `{"error": {"message", "type", "param", "code"}}` with `code` the HTTP
status: unknown model 404, bad JSON and invalid parameters 400 (vLLM does not use 422), adapter
errors as AdapterError says. `/v1/responses` is served over the chat path with the translation in
`rlproxy.wire.responses` (function tools, `instructions`, `input` as text or items, streamed
events); what it cannot serve is a 400 `invalid_request_error`. Responses are kept (unless the request
says `store: false`) in a bounded in-memory store, the newest `responses_kept` only (vLLM keeps them
only with VLLM_ENABLE_RESPONSES_API_STORE=1, and without bound); `previous_response_id` continues
from one, and an unknown or evicted id is a 404 like vLLM's.

The routes never run model code: they hand work to the engine's worker thread (`Generation`,
`Engine.call`) and await it, so the event loop stays free.

A client that goes away (or a proxy that gives up and closes its connection) cancels its request:
`CancelOnDisconnect` runs each request as a task and cancels it on `http.disconnect`, which ends
the route's `async with Generation` and drops its rows from the engine before the next decode step
(issue 22). This covers every route, streaming or not: nothing decodes for a client that left.

(Over 400 lines by a little: it mirrors vLLM's one server module route for route; the bodies and
streams the routes answer with are `answers.py`, the translations `rlproxy/wire/`, the model work
`engine.py`.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlproxy.errors import AdapterError, APIError
from rlproxy.inference.answers import (
    ResponseStore,
    chat_result,
    chat_stream,
    completion_result,
    completion_stream,
    event_stream,
)
from rlproxy.inference.engine import Engine
from rlproxy.inference.generation import Choice, Generation
from rlproxy.inference.protocol import ChatBody, CompletionBody, LoadLoRABody, UnloadLoRABody
from rlproxy.inference.tools import messages_for_template
from rlproxy.wire import message_events as anthropic_events
from rlproxy.wire import messages as anthropic
from rlproxy.wire.response_events import ResponseEvents, response_object
from rlproxy.wire.responses import ResponsesInputError, chat_request, conversation

log = logging.getLogger(__name__)

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
RESPONSES_KEPT = 1024  # responses kept for previous_response_id / GET, oldest evicted first


router = APIRouter()


def create_engine_app(
    engine: Engine, api_key: str | None = None, responses_kept: int = RESPONSES_KEPT
) -> FastAPI:
    """The OpenAI app for one engine (`api_key`, `responses_kept`: see the module doc); the caller
    starts and closes it."""
    app = FastAPI(title="rlproxy embedded engine", redirect_slashes=False)
    app.add_middleware(CancelOnDisconnect)
    if api_key:
        app.add_middleware(BearerCheck, api_key=api_key)
    app.state.engine = engine
    app.state.created = int(time.time())  # the `created` of every /v1/models entry
    app.state.responses = ResponseStore(responses_kept)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _internal)
    app.include_router(router)
    return app


class BearerCheck:
    """Pure ASGI: 401 unless `Authorization: Bearer <key>` (compared in constant time); `/health` open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = b'{"error":"Unauthorized"}'
                headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class CancelOnDisconnect:
    """Pure ASGI: run the request as a task and cancel it when the client disconnects.

    The app reads its body through `receive` as usual; once the body is in, a watcher owns
    `receive` and waits for `http.disconnect` (the app's own later calls just wait for it too).
    A disconnect after the response's last byte cancels nothing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_in, gone = asyncio.Event(), asyncio.Event()
        sent = {"done": False}

        async def app_receive() -> Message:
            if body_in.is_set():
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                body_in.set()
            return message

        async def app_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, app_receive, app_send))

        async def watch() -> None:
            await body_in.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if not sent["done"] and not task.done():
                log.info("client of %s went away; cancelling its generation", scope.get("path"))
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await task
        except asyncio.CancelledError:
            if not gone.is_set():  # we were cancelled ourselves (shutdown): pass it on
                raise
        finally:
            watcher.cancel()


# ---------------------------------------------------------------------------------------------
# Routes


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    engine, created = _engine(request), request.app.state.created

    def card(id: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        return {
            "id": id,
            "object": "model",
            "created": created,
            "owned_by": "rlproxy",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [],
        }

    data = [card(engine.served_name, engine.model_path, None, engine.max_model_len)]
    data += [card(name, path, engine.served_name, None) for name, path in engine.adapters.listing().items()]
    return {"object": "list", "data": data}


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    body: LoadLoRABody = await _parse(request, LoadLoRABody)
    work = _engine(request).load_adapter(body.lora_name, body.lora_path, body.load_inplace)
    return await _adapter_answer(work, f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    body: UnloadLoRABody = await _parse(request, UnloadLoRABody)
    work = _engine(request).unload_adapter(body.lora_name)
    return await _adapter_answer(work, f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    engine = _engine(request)
    body: ChatBody = await _parse(request, ChatBody)
    adapter = _adapter_for(engine, body.model)
    prompt = _chat_prompt(engine, body)
    return await _generate(engine, body, [prompt], adapter, "chatcmpl", chat_stream, chat_result)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    engine = _engine(request)
    body: CompletionBody = await _parse(request, CompletionBody)
    adapter = _adapter_for(engine, body.model)
    tok = engine.tokenizer
    prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
    vocab = len(tok)
    for p in prompts:
        if not p or any(not isinstance(t, int) or t < 0 or t >= vocab for t in p):
            raise APIError(400, "prompt token ids must be in [0, vocab size) and non-empty", param="prompt")
    return await _generate(engine, body, prompts, adapter, "cmpl", completion_stream, completion_result)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    engine, store = _engine(request), request.app.state.responses
    body = await _json(request)
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", type="invalid_request_error")
    history = None
    if isinstance(body.get("previous_response_id"), str):
        history = store.history(body["previous_response_id"])
    try:
        chat_dict = chat_request(body, history)
    except ResponsesInputError as exc:
        raise APIError(400, str(exc), type="invalid_request_error", param=exc.param) from exc
    chat_body: ChatBody = _validate(ChatBody, chat_dict)
    adapter = _adapter_for(engine, chat_body.model)
    gen, meta = _start(engine, chat_body, [_chat_prompt(engine, chat_body)], adapter, "chatcmpl")
    ids = {"response_id": f"resp_{uuid.uuid4().hex}", "created_at": meta["created"]}
    keep = body.get("store") is not False
    if chat_body.stream:
        events = ResponseEvents(body, model=meta["model"], **ids)
        stream = event_stream(engine.tokenizer, gen, chat_body, meta, events, store if keep else None)
        return StreamingResponse(stream, media_type="text/event-stream")
    chat = {**meta, **chat_result(engine.tokenizer, gen, chat_body, await _finished(gen))}
    answer = response_object(body, chat, **ids)
    if keep:
        store.put(answer, conversation(chat_dict, chat["choices"][0]["message"]))
    return JSONResponse(answer)


async def _messages_chat(request: Request, convert: Any) -> dict:
    """A Messages body read and `convert`ed to its chat form; a 400 of Anthropic's type if it is none."""
    body = await _json(request)
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", type="invalid_request_error")
    try:
        return convert(body)
    except anthropic.MessagesInputError as exc:
        raise APIError(400, str(exc), type="invalid_request_error", param=exc.param) from exc


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    """Anthropic's Messages API over the chat path (`rlproxy.wire.messages`); errors in Anthropic's
    shape; `max_tokens` past what the context leaves is clamped to it (as the proxy does)."""
    engine = _engine(request)
    try:
        chat_body: ChatBody = _validate(ChatBody, await _messages_chat(request, anthropic.chat_request))
        adapter = _adapter_for(engine, chat_body.model)
        prompt = _chat_prompt(engine, chat_body)
        if len(prompt) + (chat_body.max_tokens or 0) > engine.max_model_len:
            chat_body.max_tokens = None  # until the context is full: what it leaves
        gen, meta = _start(engine, chat_body, [prompt], adapter, "chatcmpl")
    except APIError as exc:
        return JSONResponse(anthropic.error_body(exc.status, exc.message), status_code=exc.status)
    message_id = anthropic_events.new_message_id()
    if chat_body.stream:
        events = anthropic_events.MessageEvents(message_id=message_id, model=meta["model"])
        return StreamingResponse(
            event_stream(engine.tokenizer, gen, chat_body, meta, events), media_type="text/event-stream"
        )
    try:
        chat = {**meta, **chat_result(engine.tokenizer, gen, chat_body, await _finished(gen))}
    except APIError as exc:
        return JSONResponse(anthropic.error_body(exc.status, exc.message), status_code=exc.status)
    return JSONResponse(anthropic_events.message_object(chat, message_id=message_id))


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(request: Request) -> Response:
    """`{"input_tokens": N}`: the prompt of the Messages body's chat form, through the chat template."""
    engine = _engine(request)
    try:
        chat = await _messages_chat(request, anthropic.count_request)
        _adapter_for(engine, chat.get("model"))
        prompt = _chat_prompt(engine, _validate(ChatBody, chat))
    except APIError as exc:
        return JSONResponse(anthropic.error_body(exc.status, exc.message), status_code=exc.status)
    return JSONResponse({"input_tokens": len(prompt)})


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's `/tokenize`: `{messages, tools?}` through the chat template (the generation prompt
    added unless `add_generation_prompt` is false), or `{prompt}` as text; `{count, max_model_len,
    tokens}`."""
    engine = _engine(request)
    body = await _json(request)
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    _adapter_for(engine, body.get("model"))
    if "messages" in body:
        chat: ChatBody = _validate(ChatBody, {"messages": body.get("messages"), "tools": body.get("tools")})
        tokens = _chat_prompt(engine, chat, body.get("add_generation_prompt", True) is not False)
    elif isinstance(body.get("prompt"), str):
        special = body.get("add_special_tokens", True) is not False
        tokens = engine.tokenizer.encode(body["prompt"], add_special_tokens=special)
    else:
        raise APIError(400, "either 'messages' or 'prompt' (a string) is required", param="messages")
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    return JSONResponse(request.app.state.responses.get(response_id))


# ---------------------------------------------------------------------------------------------
# Request plumbing shared by the routes


def _engine(request: Request) -> Engine:
    return request.app.state.engine


async def _json(request: Request) -> Any:
    """The request body as JSON; bad JSON is APIError(400)."""
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise APIError(400, f"Invalid JSON body: {exc}", type="BadRequestError") from exc


async def _parse(request: Request, cls: type[BaseModel]) -> Any:
    """The request body as `cls`; bad JSON or invalid values are APIError(400)."""
    return _validate(cls, await _json(request))


def _validate(cls: type[BaseModel], raw: Any) -> Any:
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ())) or None
        raise APIError(400, f"{first.get('msg')} ({param})", type="BadRequestError", param=param) from exc


def _chat_prompt(engine: Engine, body: ChatBody, add_generation_prompt: bool = True) -> list[int]:
    """The prompt token ids of a chat body (its messages and tools through the chat template)."""
    try:
        text = engine.tokenizer.apply_chat_template(
            messages_for_template(body.messages),
            tools=body.tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:  # template errors are the caller's messages, not a server fault
        raise APIError(400, f"cannot apply the chat template: {exc}", type="BadRequestError") from exc
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _adapter_for(engine: Engine, model: str | None) -> str | None:
    """None for the base model, else the adapter name; unknown names are 404 like vLLM."""
    if model in (None, "", engine.served_name, engine.model_path):
        return None
    if model in engine.adapters.names:
        return model
    raise APIError(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model")


async def _adapter_answer(work: concurrent.futures.Future, success: str) -> Response:
    """Await an adapter load/unload on the worker thread: `success` as text, or vLLM's error body."""
    try:
        await asyncio.wrap_future(work)
    except AdapterError as exc:
        return _error(exc.status, str(exc), type="InvalidUserInput" if exc.status == 400 else None)
    return PlainTextResponse(success)


async def _generate(
    engine: Engine,
    body: ChatBody | CompletionBody,
    prompts: list[list[int]],
    adapter: str | None,
    id_prefix: str,
    stream: Callable[[Any, Generation, Any, dict[str, Any]], AsyncIterator[str]],
    result: Callable[[Any, Generation, Any, list[Choice]], dict[str, Any]],
) -> Response:
    """Run `prompts` × `body.n` on the engine: an SSE stream of `stream`'s chunks, or one JSON body
    (`result`) once every choice has finished; both start with the same id/created/model."""
    gen, meta = _start(engine, body, prompts, adapter, id_prefix)
    if body.stream:
        return StreamingResponse(stream(engine.tokenizer, gen, body, meta), media_type="text/event-stream")
    return JSONResponse({**meta, **result(engine.tokenizer, gen, body, await _finished(gen))})


def _start(
    engine: Engine,
    body: ChatBody | CompletionBody,
    prompts: list[list[int]],
    adapter: str | None,
    id_prefix: str,
) -> tuple[Generation, dict[str, Any]]:
    """The (not yet submitted) generation of `prompts` and its id/created/model; 400 past the context."""
    params = body.params(engine.sampling_defaults)
    limit = engine.max_model_len
    for p in prompts:
        if len(p) + (params.max_tokens or 1) > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{(params.max_tokens or 1)} output tokens and your prompt contains {len(p)} input tokens.",
                type="BadRequestError",
            )
    gen = Generation(engine, prompts, params, body.n, adapter, body.priority, salt=body.cache_salt)
    meta = {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body.model or engine.served_name,
    }
    return gen, meta


async def _finished(gen: Generation) -> list[Choice]:
    """Run `gen` to the end; a failed row is a 500."""
    async with gen:
        results = await gen.finish()
    if any(c.finish_reason == "error" for c in results):
        raise APIError(500, "the engine failed while generating; see its log", type="InternalServerError")
    return results


def _error(status: int, message: str, param: str | None = None, type: str | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.param, exc.type)


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    log.exception("engine request failed")
    return _error(500, f"internal error: {exc}", type="InternalServerError")
