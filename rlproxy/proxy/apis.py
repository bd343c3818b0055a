"""The wire APIs the hot path serves, one row each (`APIS`): all that differs between them is here.

Read by `routes_openai` (`ROUTES`, `route`: which row a POST path is, also under `/runs/{run_id}/`;
`complete` reads its fields; the pass-through its `side` routes), `guard.Guard` (`KEY_HEADERS`),
`ProxyState.drop_headers` (`DROP`) and `ErrorShapes` (a row's error shape on its paths).

A translated API's `prepare(px, scope, body)` gives a call: `.chat` (the chat body forwarded,
captured and stored as `request`), `.body` (stored as `client_request`), `.run_id` (a run it
continues, or None), `.response_id`/`.store` (an id a later request may name), `.answer(chat)` and
`.events(model)` (a `stream.EventStream` over its wire/ translator); see `proxy/responses.py`.
Adding one (Gemini's `generateContent`, on paper): `wire/gemini.py` (pure translations), its
`proxy/gemini.py` (`prepare` reading the model and `:streamGenerateContent` from `scope["path"]`,
`error`), and `WireAPI("gemini", "v1beta/models/", errors=gemini.error, key_header=b"x-goog-api-key",
query=False, prepare=gemini.prepare)` here; the hot path's body does not change.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rlproxy.proxy import messages, responses
from rlproxy.storage.records import Endpoint


@dataclass(frozen=True, slots=True)
class WireAPI:
    """One client API: its path, how it reaches the upstream's completions and how it answers."""

    name: str  # its `completions.endpoint` value
    route: str  # the POST path without its leading slash; ending in "/": every path below it
    upstream: bytes = b"/v1/chat/completions"  # the upstream's path it is served over
    form: str = Endpoint.CHAT  # what `upstream` takes: checked (validate.py) and captured as
    prepare: Callable[[Any, dict, dict], Awaitable[Any]] | None = None  # the translation (module doc)
    side: Callable[[Any, Any, str], Awaitable[Any]] | None = None  # (px, request, path): its other routes
    errors: Callable[[int, bytes], tuple[int, bytes]] | None = None  # an OpenAI error -> its own
    key_header: bytes | None = None  # where its SDKs send the key (as it is, no `Bearer `)
    query: bool = True  # False: the query string is the API's own (`?beta=true`), not forwarded
    clamp: bool = False  # a 400 for prompt + max_tokens past the context: sent again without max_tokens


APIS: tuple[WireAPI, ...] = (
    WireAPI(Endpoint.CHAT, "v1/chat/completions"),
    WireAPI(Endpoint.COMPLETIONS, "v1/completions", b"/v1/completions", Endpoint.COMPLETIONS),
    WireAPI("responses", "v1/responses", prepare=responses.prepare, side=responses.side),
    WireAPI(
        "messages",
        "v1/messages",
        prepare=messages.prepare,
        side=messages.side,
        errors=messages.error,
        key_header=b"x-api-key",
        query=False,
        clamp=True,
    ),
)
ROUTES = {api.route: api for api in APIS if api.route[-1] != "/"}
_PREFIXED = tuple(api for api in APIS if api.route[-1] == "/")
_SHAPED = tuple(api for api in APIS if api.errors is not None)
KEY_HEADERS = tuple(api.key_header for api in APIS if api.key_header is not None)
DROP = frozenset({b"authorization", *KEY_HEADERS})  # never forwarded: the client's key is ours


def route(tail: str) -> WireAPI | None:
    """The row of a POST path (`tail`: without its leading slash) that `ROUTES` does not name: a hot
    route with a trailing slash (captured like the plain one, never passed through), or a prefix."""
    if tail[-1:] == "/" and tail[:-1] in ROUTES:
        return ROUTES[tail[:-1]]
    for api in _PREFIXED:
        if tail.startswith(api.route):
            return api
    return None


def owner(path: str, apis: tuple[WireAPI, ...] = APIS) -> WireAPI | None:
    """The row whose route `path` is or is below (also under `/runs/{run_id}/`)."""
    if path.startswith("/runs/"):
        parts = path.split("/", 3)
        path = "/" + parts[3] if len(parts) == 4 else path
    for api in apis:
        r = api.route
        if path.startswith(r, 1) and (len(path) == len(r) + 1 or path[len(r) + 1] == "/" or r[-1] == "/"):
            return api
    return None


class ErrorShapes:
    """ASGI: on an API's paths whose row has `errors`, every error answer (status >= 400) in its
    shape (Anthropic's on /v1/messages); other paths untouched."""

    def __init__(self, app) -> None:
        self.app = app

    def __getattr__(self, name: str):
        return getattr(self.app, name)  # transparent: the stack below keeps its attributes (in_flight)

    async def __call__(self, scope, receive, send) -> None:
        api = owner(scope["path"], _SHAPED) if scope["type"] == "http" and _SHAPED else None
        if api is None:
            await self.app(scope, receive, send)
            return
        held: dict | None = None
        parts: list[bytes] = []

        async def rewrite(message: dict) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, body = api.errors(held["status"], b"".join(parts))
            headers = [
                (k, v)
                for k, v in held.get("headers", ())
                if k.lower() not in (b"content-length", b"content-type")
            ]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)
