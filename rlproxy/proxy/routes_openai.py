"""The OpenAI routes: forward, capture, route to the policy's adapter; plus the pass-through.

`POST /v1/chat/completions` and `POST /v1/completions` (also under `/runs/{run_id}/v1/...`) are the
hot path, served by `HotPath`, a pure ASGI app in front of FastAPI's router: the body is read as
raw bytes and checked by hand (no pydantic model), rewritten for the upstream (model ->
`{policy}@{step}`, capture fields injected), forwarded over `forward.Upstream`, and answered with what
the upstream said minus the injected fields, plus `X-Policy-Step`. A non-streaming completion is
submitted to the writer just before its response is sent (`submit` journals and enqueues); a
stream's just before its last chunk. Every other `/v1/*` path goes through FastAPI and is relayed
untouched, except the engine-management routes (`ENGINE_ONLY`, 403) and upstream redirects (502,
never relayed). A hot route with a trailing slash (`/v1/chat/completions/`) is captured like the
plain one. The composition root (`rlproxy/compose.py`) puts `HotPath` in front of FastAPI.

What the upstream answers is checked before it is relayed or captured: a redirect is refused (502,
as on the pass-through: it would name the engine's address), and a 200 that is not a completion of
the OpenAI shape (`capture.shape_problem`; or one the Responses translation cannot read) is a 502
in OpenAI's shape, stored as an error row with the reason. No client-facing error names the
upstream (`errors.public_message`); the stored row and the log keep the detail.

Which path is which API, and all that differs between them, is one table (`proxy/apis.py`):
`POST /v1/responses` and `POST /v1/messages` are hot routes too, served over the upstream's chat
completions: the row's `prepare` translates the body to the chat body that is forwarded, captured
and stored as `request`, and its call translates the chat answer back for the client. An API's other
routes (`GET /v1/responses/{id}`, `POST /v1/messages/count_tokens`) are its row's `side`.

A client that hangs up cancels its upstream call, streaming (`proxy/stream.py`) or not
(`_unless_gone`): the protocol says the connection is lost (`server.hangup_calls`), the call is
cancelled, which closes its pooled connection, so the engine drops the request at once; the
completion is stored `cancelled` (499).

An app's key (proxy/keys.py) scopes what a request names: its run and group ids live in the key's
namespace, its policies, prefix cache and limits are its own (`KeyRing.enter`).

(Over 400 lines: one request of the hot path, from its bytes to its answer and its record, reads
top to bottom here; the translations, the stream relay and the keys are in their own files.)
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from datetime import UTC, datetime

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from rlproxy.errors import APIError, BackendRedirect, RLProxyError
from rlproxy.proxy import apis, capture, errors, forward, hosted, keys, routes_runs, runkey, server, validate
from rlproxy.proxy.apis import ROUTES, WireAPI
from rlproxy.proxy.stream import EventStream, StreamRelay
from rlproxy.storage.records import CompletionRecord

logger = logging.getLogger(__name__)
_CONTEXT = re.compile(rb"maximum context length|max_model_len", re.IGNORECASE)  # the engine, vLLM


class HotPath:
    """ASGI: serve the completion and reward routes directly, hand everything else to `app` (FastAPI)."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            run_id, tail = None, path[1:]
            if path.startswith("/runs/"):
                run_id, _, tail = tail[5:].partition("/")
            api = ROUTES.get(tail) or apis.route(tail)
            reward = None if api is not None else routes_runs.reward_route(path)
            if api is not None or reward is not None:
                try:
                    if api is not None:
                        response = await complete(self.state, scope, receive, api, run_id)
                    else:
                        response = await routes_runs.post_reward(self.state, scope, receive, *reward)
                except validate.ClientGone:
                    return
                except (APIError, RLProxyError) as exc:
                    keys.unscope_error(exc, scope.get(keys.SCOPE_KEY))  # the app's ids as it wrote them
                    response = errors.render(exc, f"POST {path}")
                except Exception as exc:  # never let a bug take the connection down without an answer
                    response = errors.internal_error(exc, f"POST {path}")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def complete(px, scope, receive, api: WireAPI, path_run_id: str | None) -> Response | _Answer:
    """Forward one completion request and capture it (see the module doc)."""
    started = time.perf_counter()
    created_at = datetime.now(UTC)
    key = scope.get(keys.SCOPE_KEY)  # an app's key (proxy/keys.py); None: the shared agents' key
    run_id = group_id = declared = split = None
    for k, v in scope["headers"]:
        if k == b"x-run-id":
            run_id = v.decode("latin-1")
        elif k == b"x-group-id":
            group_id = v.decode("latin-1")
        elif k == b"x-split":
            split = v.decode("latin-1")
        elif k == b"content-length":
            declared = v
    if path_run_id is not None:
        run_id = path_run_id
    raw = await validate.read_body(receive, declared, px.settings.max_body_bytes)
    body = validate.parse_body(raw, px.settings.max_json_depth)
    call = None
    if api.prepare is not None:  # a translated API (proxy/apis.py)
        call = await api.prepare(px, scope, body)
        body = call.chat  # from here on the chat form: forwarded, hashed, stored
    validate.check(body, api.form)
    if run_id is not None:
        runkey.check_id(run_id)
    if group_id is not None:
        runkey.check_id(group_id, "group id")
    if split is not None:
        runkey.check_split(split)
    if key is not None:  # the app's ids live in its key's namespace: no other app can name them
        run_id = keys.scoped(key, run_id) if run_id is not None else None
        group_id = keys.scoped(key, group_id, "group id") if group_id is not None else None
    # a closed run takes no more turns; a chain inherits its previous response's run (proxy/runstate.py)
    run_id = px.runs.admit(run_id, call.run_id if call is not None else None)
    if not px.gate.is_open:
        await px.gate.wait()
    if px.writer.full:  # the store is behind: wait at its pace (bounded, then 503 + Retry-After)
        await px.writer.room(px.settings.store_wait_timeout)
    policy, step, upstream_model = px.policies.resolve(body.get("model"), run_id)
    text_only = px.hosted.get(policy) if px.hosted else None  # a hosted provider's (proxy/hosted.py)

    upstream_body = dict(body)
    upstream_body["model"] = upstream_model
    if text_only is not None:  # sent as the client wrote it: nothing injected, nothing to strip
        inj = capture.Injected()
    else:
        inj = capture.inject(upstream_body, api.form)
    stream = upstream_body.get("stream") is True
    if key is not None:  # its policies only (else 404), its own prefix cache, its limits (else 429)
        px.keys.enter(key, policy, body.get("model"), upstream_body if text_only is None else None, stream)
    elif px.keys.any and text_only is None:  # apps have keys: a client never picks another's salt
        upstream_body.pop("cache_salt", None)
    rec = CompletionRecord(  # the run, whose key; the policy, where it is served; the API, the bodies
        run_id=run_id,
        group_id=group_id,
        split=split,
        key_id=key.id if key is not None else None,
        policy=policy,
        adapter=upstream_model,
        policy_step=step,
        source=hosted.HOSTED if text_only is not None else None,
        endpoint=api.name,
        stream=stream,
        request=body,
        client_request=call.body if call is not None else None,
        created_at=created_at,
    )
    if run_id is not None:
        px.inflight.enter(run_id)
    handed_off = False
    try:
        headers = forward.request_headers(scope["headers"], px.drop_headers, identity=True)
        query = scope["query_string"] if api.query else b""
        call_upstream = (text_only or px.upstream).post(
            api.upstream, headers, orjson.dumps(upstream_body), query, stream, run_id
        )
        # a stream's relay watches the client itself (proxy/stream.py); a plain call is raced here
        resp = await (call_upstream if stream else _unless_gone(call_upstream, scope, receive))
        if api.clamp and resp.status_code == 400 and text_only is None:
            # the engine's context refusal (a provider's is the answer: hosted policies never fall back)
            resp = await _unclamped(px, resp, rec, upstream_body, headers, stream, run_id, api.upstream)
        # the serving step is the operator's to see (the dashboard), not an agent's: unless told
        # (disclose_policy_step), an app cannot tell a canary's arms apart
        step_header = (b"x-policy-step", str(step).encode()) if px.settings.disclose_policy_step else None
        if stream:
            ctype = resp.header(b"content-type") or b""
            if resp.status_code == 200 and ctype.startswith(b"text/event-stream"):
                handed_off = True
                return _relay(px, resp, rec, api.form, inj, started, step_header, call, upstream_model, key)
            try:
                resp.content = resp.content or await resp.read()  # (`_unclamped` may have read it)
            finally:
                resp.close()
        return _answer(px, resp, rec, api.form, inj, started, step_header, call)
    except _ClientGone:
        rec.status, rec.status_code, rec.error = "cancelled", 499, "client disconnected"
        rec.latency_ms = (time.perf_counter() - started) * 1000.0
        _submit(px, rec)
        px.metrics.observe(api.name, "cancelled", rec.latency_ms / 1000.0)
        return Response(status_code=499)  # nobody reads it: the connection is gone
    except RLProxyError as exc:
        rec.status = "error"
        rec.status_code = exc.status
        rec.error = str(exc)  # the detail (the upstream's URL too) stays in the store and the log
        rec.latency_ms = (time.perf_counter() - started) * 1000.0
        _submit(px, rec)
        px.metrics.observe(api.name, f"upstream_{rec.status_code}", rec.latency_ms / 1000.0)
        raise
    finally:
        if run_id is not None and not handed_off:
            px.inflight.leave(run_id)
        if key is not None and stream and not handed_off:
            px.keys.stream_done(key)


def _submit(px, rec: CompletionRecord) -> None:
    """Hand `rec` to the writer; an app key's tokens count against its tpm from now on."""
    px.writer.submit(rec)
    if rec.key_id is not None:
        px.keys.spent(rec.key_id, (rec.prompt_tokens or 0) + (rec.completion_tokens or 0))


class _ClientGone(Exception):
    """The client hung up while its non-streaming upstream call ran (the call was cancelled)."""


async def _unless_gone(call, scope, receive):
    """Await the upstream call `call` in this task unless the client hangs up first: this task is
    then cancelled, which closes the call's pooled connection so the engine stops decoding, and
    `_ClientGone` is raised (`server.hangup_calls` says when: under `rlproxy serve` the protocol,
    with no task per request)."""
    me = asyncio.current_task()
    gone = False

    def hang_up() -> None:
        nonlocal gone
        gone = True
        me.cancel()

    try:
        with server.hangup_calls(scope, receive, hang_up):
            return await call
    except asyncio.CancelledError:
        if gone and me.uncancel() == 0:  # our own cancel, not the server's shutdown
            raise _ClientGone from None
        raise


def _answer(
    px, resp, rec: CompletionRecord, form: str, inj: capture.Injected, started: float, step_header, call=None
) -> Response | _Answer:
    """A non-streaming answer: capture, strip, submit, respond (a Responses call: translated back)."""
    content = resp.content
    if 300 <= resp.status_code < 400:  # never relayed: its Location names the engine's address
        raise BackendRedirect(f"the upstream answered with a redirect ({resp.status_code}); not followed")
    rec.status_code = resp.status_code
    parsed = None
    try:
        parsed = orjson.loads(content)
    except orjson.JSONDecodeError:
        pass
    if resp.status_code == 200:
        problem = capture.shape_problem(parsed, form)
        if problem is None:
            try:
                capture.coerce_usage(parsed)
                capture.from_response(parsed, form, inj, rec)
                if call is not None:
                    rec.client_response = call.answer(parsed)
                    rec.response_id = call.response_id if call.store else None
                    content = orjson.dumps(rec.client_response)
                elif inj.any:
                    content = orjson.dumps(parsed)
            except Exception as exc:  # a shape the checks let through but capture cannot read
                logger.warning("upstream answer could not be captured: %r", exc)
                problem = f"the answer could not be read ({type(exc).__name__})"
        if problem is not None:
            return _malformed(px, rec, started, parsed, content, problem, step_header)
        if rec.source is not None:  # a hosted row: no token ids, marked (proxy/hosted.py)
            hosted.text_only(rec)
        rec.status = "ok"
        outcome = "ok"
    else:
        rec.status = "error"
        rec.response = parsed if isinstance(parsed, dict) else None
        rec.error = content.decode("utf-8", "replace")[:4000]
        outcome = f"upstream_{resp.status_code}"
    rec.latency_ms = (time.perf_counter() - started) * 1000.0
    _submit(px, rec)
    px.metrics.observe(rec.endpoint, outcome, rec.latency_ms / 1000.0)
    headers = forward.response_headers(resp.headers)
    if resp.status_code >= 500:  # its body may name paths and hold a traceback: stored and logged only
        content, headers = errors.upstream_failure(resp.status_code, content, headers, rec.run_id)
    headers.append((b"content-length", str(len(content)).encode()))
    if step_header is not None:
        headers.append(step_header)
    return _Answer(resp.status_code, headers, content)


class _Answer:
    """A non-streaming answer as ASGI: the head, then the whole body (what starlette's Response
    does, without building its headers again: this runs on every request)."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


async def _unclamped(px, resp, rec: CompletionRecord, upstream_body: dict, headers, stream, run_id, path):
    """A call refused for prompt + max_tokens past the context (a row with `clamp`: Messages, whose
    agent CLIs ask 32000 whatever the context; see proxy/messages.py) is sent again without
    max_tokens, so the answer stops where the context is full; otherwise the refusal, read whole."""
    try:
        resp.content = await resp.read() if stream else resp.content
    finally:
        if stream:
            resp.close()
    if "max_tokens" not in upstream_body or not _CONTEXT.search(resp.content[:2000]):
        return resp
    del upstream_body["max_tokens"]
    rec.request = {k: v for k, v in rec.request.items() if k != "max_tokens"}
    return await px.upstream.post(path, headers, orjson.dumps(upstream_body), b"", stream, run_id)


def _malformed(
    px, rec: CompletionRecord, started: float, parsed, content: bytes, problem: str, step_header
) -> Response:
    """A 200 that is no completion: 502 in OpenAI's shape; stored as an error row with the reason."""
    rec.status = "error"
    rec.status_code = 502
    rec.prompt_token_ids = rec.token_ids = rec.logprobs = rec.finish_reason = None  # (not served)
    rec.prompt_tokens = rec.completion_tokens = None
    rec.response = parsed if isinstance(parsed, dict) else None
    rec.client_response = None
    rec.response_id = None
    rec.error = f"malformed upstream answer: {problem}; body: {content[:2000].decode('utf-8', 'replace')}"
    rec.latency_ms = (time.perf_counter() - started) * 1000.0
    _submit(px, rec)
    px.metrics.observe(rec.endpoint, "upstream_malformed", rec.latency_ms / 1000.0)
    logger.warning("malformed upstream answer (run %s): %s", rec.run_id, problem)
    response = errors.error_response(502, errors.MALFORMED, code="upstream_malformed")
    if step_header is not None:
        response.raw_headers.append(step_header)
    return response


def _relay(
    px,
    resp,
    rec: CompletionRecord,
    form: str,
    inj: capture.Injected,
    started: float,
    step_header,
    call=None,
    model: str = "",
    key: keys.AppKey | None = None,
) -> StreamRelay:
    """A streaming answer: relay while assembling; store when it ends (however it ends)."""
    assembler = capture.StreamAssembler(form, inj)
    translate: EventStream | None = call.events(model) if call is not None else None

    def done(status: str, error: str | None, ttft: float | None, status_code: int) -> None:
        try:
            assembler.result(rec)
            if rec.source is not None:  # a hosted row: no token ids, marked (proxy/hosted.py)
                hosted.text_only(rec)
            rec.status = status
            rec.status_code = status_code
            rec.error = (
                error if error is not None else ("client disconnected" if status == "cancelled" else None)
            )
            rec.latency_ms = (time.perf_counter() - started) * 1000.0
            rec.ttft_ms = ttft * 1000.0 if ttft is not None else None
            if translate is not None:
                rec.client_response = translate.response
                rec.response_id = call.response_id if call.store and status == "ok" else None
            _submit(px, rec)
            px.metrics.observe(rec.endpoint, status, rec.latency_ms / 1000.0, ttft)
        finally:
            if rec.run_id is not None:
                px.inflight.leave(rec.run_id)
            if key is not None:
                px.keys.stream_done(key)

    headers = forward.response_headers(resp.headers)
    if step_header is not None:
        headers.append(step_header)
    max_event = px.settings.max_stream_event_bytes
    return StreamRelay(resp, headers, assembler, inj, started, done, translate, max_event=max_event)


# vLLM's engine-management routes under /v1 (0.32: the other ones, /sleep, /collective_rpc,
# /update_weights, ..., are outside /v1, which is all the pass-through serves). The trainer reaches
# the engine directly; through the proxy no client, operator included, may change what is served.
ENGINE_ONLY = frozenset({"load_lora_adapter", "unload_lora_adapter"})


async def _pass(request: Request, path: str) -> Response:
    if path.rstrip("/") in ENGINE_ONLY:
        raise APIError(
            403,
            f"/v1/{path} manages the inference engine and is not served through the proxy "
            "(the trainer loads adapters on the engine directly)",
            code="engine_route_forbidden",
        )
    px = request.app.state.proxy
    api = apis.owner("/v1/" + path)
    if api is not None and api.side is not None:  # an API's other routes (GET /v1/responses/{id}, ...)
        answer = await api.side(px, request, path)
        if answer is not None:
            return answer
    return await px.upstream.relay(request, "/v1/" + path, px.drop_headers)


passthrough = APIRouter()
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@passthrough.api_route("/v1/{path:path}", methods=_METHODS, include_in_schema=False)
async def v1_any(request: Request, path: str) -> Response:
    """Any other OpenAI-style path, relayed untouched."""
    return await _pass(request, path)


@passthrough.api_route("/runs/{run_id}/v1/{path:path}", methods=_METHODS, include_in_schema=False)
async def run_v1_any(request: Request, run_id: str, path: str) -> Response:
    """The same under a run prefix (the run id is checked, then dropped)."""
    runkey.check_id(run_id)
    return await _pass(request, path)
