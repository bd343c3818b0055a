"""The request guard: one pure ASGI middleware in front of every route, hot path included.

In this order, from one scan of the request headers (no body read, streams untouched):

1. Canonical path (400 `invalid_path`): no dot segments (`/v1/../health`), no encoded dots,
   slashes, backslashes, percent signs or NULs (`%2e`, `%2f`, `%5c`, `%25`, `%00`), no empty
   segments (`//`), no backslashes; a request target must start with `/`. So no path can name a
   route other than the one it spells, here or on the upstream.
2. Host allowlist (421 `invalid_host`), against DNS rebinding: `allowed_hosts`, or by default,
   when bound to a loopback address, only `localhost`, `127.0.0.1` and `[::1]` (any port).
3. Browsers (403 `cross_origin_refused`): a request with an `Origin` header must come from the same
   origin (Origin == http(s)://Host) or from `cors_origins`; without `Origin`,
   `Sec-Fetch-Site: cross-site` is refused. Configured origins get proper CORS answers (preflight
   and response headers) from Starlette's `CORSMiddleware`, which only such requests go through.
4. Keys (401, 403): `auth.Principals` (agents', apps' and operators' keys), sent as `Authorization:
   Bearer <key>` or in a wire API's own key header (`apis.KEY_HEADERS`: `x-api-key: <key>`, as
   Anthropic's SDKs do), used when there is no Authorization; an app's key (proxy/keys.py) is left
   in the scope for the routes.
5. POST/PUT/PATCH need `Content-Type: application/json` (415 `unsupported_media_type`), so an
   HTML form or a `text/plain` fetch from a web page can never be served.

Everything it refuses is answered here in OpenAI's error shape; nothing refused reaches a route.
"""

from __future__ import annotations

import ipaddress
import logging

from starlette.middleware.cors import CORSMiddleware

from rlproxy.proxy.apis import KEY_HEADERS
from rlproxy.proxy.auth import Principals, Refusal
from rlproxy.proxy.errors import error_body, send_json
from rlproxy.proxy.keys import SCOPE_KEY

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({b"localhost", b"127.0.0.1", b"[::1]"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_BAD_ESCAPES = (b"%2e", b"%2f", b"%5c", b"%25", b"%00")
_JSON = b"application/json"


def path_problem(raw: bytes) -> str | None:
    """Why the raw request path is not canonical, or None when it is."""
    if raw[:1] != b"/":
        return "the request target must be a path starting with '/'"
    if b"%" in raw:
        low = raw.lower()
        for escape in _BAD_ESCAPES:
            if escape in low:
                return f"percent-encoded {escape.decode()} is not allowed in the path"
    if b"\\" in raw:
        return "backslashes are not allowed in the path"
    if b"//" in raw:
        return "empty path segments ('//') are not allowed"
    if b"/." in raw and any(seg in (b".", b"..") for seg in raw.split(b"/")):
        return "dot segments ('.', '..') are not allowed in the path"
    return None


def is_loopback(host: str) -> bool:
    """True for a loopback bind address (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(value: bytes) -> bytes:
    """The name part of a Host header value, lower-cased: `[::1]:8000` -> `[::1]`, `a:80` -> `a`."""
    if value[:1] == b"[":
        return value[: value.find(b"]") + 1].lower()
    return value.partition(b":")[0].lower()


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def allowed_host_names(allowed_hosts: str, bind_host: str) -> frozenset[bytes] | None:
    """The Host names to accept; None means any (see the module doc)."""
    names = _split(allowed_hosts)
    if "*" in names:
        return None
    if names:
        return frozenset(host_name(n.encode()) for n in names)  # a port given is ignored
    return LOOPBACK_HOSTS if is_loopback(bind_host) else None


class Guard:
    """ASGI: the checks of the module doc, then `app`."""

    def __init__(
        self,
        app,
        principals: Principals,
        allowed_hosts: frozenset[bytes] | None = LOOPBACK_HOSTS,
        cors_origins: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.principals = principals
        self.hosts = allowed_hosts
        origins = [o.rstrip("/") for o in cors_origins]  # a browser's Origin never ends with "/"
        self.any_origin = "*" in origins
        self.origins = frozenset(o.encode() for o in origins if o != "*")
        self.cors = None
        if origins:
            self.cors = CORSMiddleware(
                app,
                allow_origins=origins,
                allow_methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                allow_headers=["*"],  # the OpenAI SDKs send x-stainless-* headers
                expose_headers=["x-policy-step", "retry-after"],
                max_age=600,
            )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = path_problem(scope.get("raw_path") or scope["path"].encode())
        if problem is not None:
            await _refuse(send, 400, f"{problem}: {scope['path']!r}", "invalid_path")
            return
        seen = dict(scope["headers"])  # names are lower-case; the last of a repeated one counts
        host, origin, authorization = seen.get(b"host"), seen.get(b"origin"), seen.get(b"authorization")
        if self.hosts is not None and (host is None or host_name(host) not in self.hosts):
            shown = host.decode("latin-1") if host is not None else "(none)"
            await _refuse(send, 421, f"Host {shown!r} is not served here (see allowed_hosts)", "invalid_host")
            return
        cors = False
        if origin is not None:
            if self.any_origin or origin in self.origins:
                cors = True
            elif origin.partition(b"://")[2].lower() != (host or b"").lower():
                await _refuse(
                    send,
                    403,
                    f"cross-origin request from {origin.decode('latin-1')!r} refused "
                    "(add the origin to cors_origins to allow it)",
                    "cross_origin_refused",
                )
                return
        elif seen.get(b"sec-fetch-site") == b"cross-site":
            await _refuse(send, 403, "cross-site browser request refused", "cross_origin_refused")
            return
        extra = ((b"access-control-allow-origin", origin), (b"vary", b"Origin")) if cors else ()
        method = scope["method"]
        if cors and method == "OPTIONS" and b"access-control-request-method" in seen:
            await self.cors(scope, receive, send)  # a preflight carries no key: CORSMiddleware answers it
            return
        if authorization is None:  # a wire API's own key header (Anthropic's SDKs send x-api-key)
            authorization = next((b"Bearer " + seen[h] for h in KEY_HEADERS if h in seen), None)
        try:
            key = self.principals.check(scope["path"], authorization)
        except Refusal as refusal:
            if refusal.status == 401:
                extra = (*extra, (b"www-authenticate", b"Bearer"))
            await _refuse(send, refusal.status, refusal.message, refusal.code, extra)
            return
        if key is not None:  # an app's key (proxy/keys.py): the routes scope what it names to it
            scope[SCOPE_KEY] = key
        ctype = seen.get(b"content-type")
        if method in _BODY_METHODS and not _is_json(ctype):
            shown = ctype.decode("latin-1") if ctype is not None else "none"
            await _refuse(
                send,
                415,
                f"Content-Type must be application/json (got {shown})",
                "unsupported_media_type",
                extra,
            )
            return
        await (self.cors if cors else self.app)(scope, receive, send)


def _is_json(ctype: bytes | None) -> bool:
    """`application/json`, optionally with parameters (`; charset=utf-8`), any case."""
    if ctype is None or ctype[:16].lower() != _JSON:
        return False
    rest = ctype[16:].lstrip()
    return not rest or rest[:1] == b";"


async def _refuse(send, status: int, message: str, code: str, headers: tuple = ()) -> None:
    await send_json(send, status, error_body(status, message, code=code), headers)
