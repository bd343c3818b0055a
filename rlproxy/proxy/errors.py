"""The one place errors become HTTP responses, always in OpenAI's error shape.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Caller mistakes are `APIError`s (they carry their status). Domain errors (`rlproxy.errors` and
`storage/errors.py`) carry theirs as class attributes (`status`, `type`, `code`, and `retry_after`
on a retryable one): backend unreachable 502, backend timeout 504, unknown run 404, conflicting
reward 409, store busy 503, anything else of ours 500. FastAPI's own validation and routing
errors are re-rendered in the same shape so a client's OpenAI SDK can always parse what it gets.

The upstream's address never reaches a client: a 502/504 about the model server (unreachable,
timed out, broke off, redirected, malformed) says what happened in words of its own
(`public_message`); the log gets the whole message, URL included.

An upstream's 5xx answer reaches the client as a generic error of the same status
(`upstream_failure`): its body (a traceback, paths) goes to the log and the store only.

A 500 tells the client nothing about the failure (no exception text, no traceback, no SQL): it
gets a generic message with an error id, and the log gets the id with the whole traceback. A
client that went away mid-request is logged quietly and answered nothing.
"""

from __future__ import annotations

import logging
import math
import secrets

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from rlproxy.errors import (
    APIError,
    BackendRedirect,
    BackendTimeout,
    BackendUnavailable,
    RLProxyError,
)
from rlproxy.proxy.validate import ClientGone

logger = logging.getLogger(__name__)

_JSON = "application/json"


def error_body(
    status: int, message: str, type: str | None = None, code: str | None = None, param=None
) -> bytes:
    """Serialized OpenAI error body; `type` defaults from the status (4xx caller, 5xx server)."""
    if type is None:
        type = "invalid_request_error" if status < 500 else "server_error"
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def error_response(
    status: int, message: str, type: str | None = None, code: str | None = None, param=None
) -> Response:
    """An OpenAI-shaped error response."""
    return Response(error_body(status, message, type, code, param), status_code=status, media_type=_JSON)


async def send_json(send, status: int, body: bytes, headers: tuple = ()) -> None:
    """Send a whole JSON response on raw ASGI `send` (the pure-ASGI layers' answers)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# What a client is told about a model-server failure (the detail, with the URL, goes to the log).
_PUBLIC = (
    (BackendTimeout, "The model server did not answer in time."),
    (BackendRedirect, "The model server answered with a redirect, which the proxy does not follow."),
    (BackendUnavailable, "The model server is unavailable or broke off its answer; retry later."),
)
MALFORMED = "The model server sent an answer that is not a valid completion."
UPSTREAM_FAILED = "The model server had an error while processing your request; retry later."


def upstream_failure(
    status: int, body: bytes, headers: list, run_id: str | None = None
) -> tuple[bytes, list]:
    """What a client gets for an upstream's 5xx answer `body`: a generic OpenAI error with the same
    status (an SDK retries it as before), never the body itself, which may hold the server's
    traceback, paths and address; the log gets the body whole. A 4xx body is the client's to read
    (what it got wrong) and is relayed as sent."""
    logger.warning(
        "upstream answered %d (run %s), not relayed: %s", status, run_id, body.decode("utf-8", "replace")
    )
    out = error_body(status, UPSTREAM_FAILED, code="upstream_error")
    kept = [(k, v) for k, v in headers if k != b"content-type"]  # (its length: the caller's to add)
    return out, [*kept, (b"content-type", b"application/json")]


def public_message(exc: BaseException) -> str:
    """The client-facing text of `exc`: its own unless it is about the upstream (then generic)."""
    for cls, text in _PUBLIC:
        if isinstance(exc, cls):
            return text
    return str(exc) or type(exc).__name__


def render(exc: APIError | RLProxyError, where: str = "a request") -> Response:
    """The response for any exception we raise on purpose: its class says status, type and code.
    A server-side failure is logged (`where`: the request, as "POST /v1/...")."""
    if isinstance(exc, APIError):
        response = Response(orjson.dumps(exc.body()), status_code=exc.status, media_type=_JSON)
        retry_after = getattr(exc, "retry_after", None)  # a key over its limits (proxy/keys.py)
        if retry_after is not None:
            response.headers["retry-after"] = str(max(1, math.ceil(retry_after)))
        return response
    if exc.status == 500:
        return internal_error(exc, where)
    message = public_message(exc)
    if message != str(exc):
        logger.warning("%s (%d to the client: %s)", exc, exc.status, message)
    elif exc.status > 500:
        logger.warning("%s failed: %s", where, exc)
    response = error_response(exc.status, message, type=exc.type, code=exc.code)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response.headers["retry-after"] = str(max(1, math.ceil(retry_after)))
    return response


def internal_error(exc: BaseException, where: str) -> Response:
    """A 500 that says nothing of `exc` to the client; the log gets it whole, under the same id."""
    ref = secrets.token_hex(6)
    logger.error("internal error %s on %s: %s", ref, where, type(exc).__name__, exc_info=exc)
    return error_response(
        500, f"The server had an error while processing your request (error id {ref}).", code="internal_error"
    )


def install(app: FastAPI) -> None:
    """Register the handlers on `app` (once, in create_app)."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        return render(exc)

    async def on_domain_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RLProxyError)
        return render(exc, f"{request.method} {request.url.path}")

    async def on_validation(request: Request, exc: Exception) -> Response:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", "invalid request"))
        return error_response(422, message, param=param, code="invalid_value")

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return Response(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            media_type=_JSON,
            headers=getattr(exc, "headers", None),
        )

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return internal_error(exc, f"{request.method} {request.url.path}")

    async def on_gone(request: Request, exc: Exception) -> Response:
        # the client left (or a deadline closed its connection) before its body arrived: no one to answer
        logger.info("%s %s: client gone before its request body arrived", request.method, request.url.path)
        return Response(status_code=499)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RLProxyError, on_domain_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(ClientDisconnect, on_gone)
    app.add_exception_handler(ClientGone, on_gone)
    app.add_exception_handler(Exception, on_unexpected)
