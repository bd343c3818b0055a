"""Forwarding to the upstream; foreign errors are translated here, once.

The two completion routes go over `http11.Pool` (pooled keep-alive connections, see http11.py for
why not httpx); every other `/v1/*` path over one pooled httpx client, relayed byte for byte
(encoding included) as a stream. Request headers go through minus the hop-by-hop ones (and `host`,
`content-length`, recomputed); response headers come back the same way. Capture routes ask the
upstream for `identity` encoding so the proxy can read and re-emit the body. Connection failures
become `BackendUnavailable` (502) and timeouts `BackendTimeout` (504), raised `from` the foreign
error with the URL in the message.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from rlproxy.errors import BackendTimeout, BackendUnavailable
from rlproxy.proxy import http11

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
# uvicorn writes its own `server` and `date`; the body we send may differ from the upstream's
_RESPONSE_DROP = HOP_BY_HOP | {b"server", b"date", b"content-encoding"}
_RELAY_DROP = HOP_BY_HOP | {b"server", b"date"}


def request_headers(raw: list[tuple[bytes, bytes]], drop: frozenset[bytes], identity: bool) -> list:
    """Client headers to send upstream (`drop` adds names to leave out, lower-case bytes)."""
    out = [(k, v) for k, v in raw if k not in HOP_BY_HOP and k not in drop]
    if identity:
        out = [(k, v) for k, v in out if k != b"accept-encoding"]
        out.append((b"accept-encoding", b"identity"))
    return out


def response_headers(raw: list[tuple[bytes, bytes]], drop: frozenset[bytes] = _RESPONSE_DROP) -> list:
    """Upstream response headers to hand the client (raw ASGI pairs, names lower-cased)."""
    return [(k.lower(), v) for k, v in raw if k.lower() not in drop]


class Upstream:
    """The upstream server: the hot routes over `http11.Pool`, everything else over httpx.

    Both are created and closed by the lifespan. Foreign errors become ours here: connection
    failures `BackendUnavailable` (502), timeouts `BackendTimeout` (504).
    """

    def __init__(self, base_url: str, timeout: float, client: httpx.AsyncClient) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.client = client
        url = urlsplit(self.base_url)
        tls = url.scheme == "https"
        self.prefix = url.path.rstrip("/").encode()
        self.pool = http11.Pool(url.hostname or "127.0.0.1", url.port or (443 if tls else 80), ssl=tls)

    async def post(
        self, path: bytes, headers: list, body: bytes, query: bytes, stream: bool
    ) -> http11.Response:
        """POST to the upstream; a non-streaming response is read whole (into `.content`)."""
        target = self.prefix + path + (b"?" + query if query else b"")
        resp = None
        try:
            async with asyncio.timeout(self.timeout):
                resp = await self.pool.request(b"POST", target, headers, body)
                if not stream:
                    resp.content = await resp.read()
        except TimeoutError as exc:
            if resp is not None:
                resp.close()
            raise BackendTimeout(
                f"upstream {self.base_url}{path.decode()} did not answer within {self.timeout:g} s"
            ) from exc
        except OSError as exc:  # ConnectionError included
            if resp is not None:
                resp.close()
            raise BackendUnavailable(f"upstream {self.base_url} is unreachable: {exc!r}") from exc
        return resp

    async def relay(self, request: Request, path: str, drop: frozenset[bytes]) -> Response:
        """Pass any other request through untouched, streaming the answer back as it comes."""
        body = await request.body()
        headers = request_headers(request.scope["headers"], drop, identity=False)
        url = self.base_url + path
        query = request.scope.get("query_string", b"")
        if query:
            url += "?" + query.decode("latin-1")
        req = self.client.build_request(request.method, url, headers=headers, content=body or None)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.TimeoutException as exc:
            raise BackendTimeout(
                f"upstream {url} did not answer within {self.timeout:g} s ({exc!r})"
            ) from exc
        except httpx.TransportError as exc:
            raise BackendUnavailable(f"upstream {url} is unreachable: {exc!r}") from exc
        out = StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, background=_Close(resp))
        out.raw_headers = response_headers(resp.headers.raw, _RELAY_DROP)
        return out

    async def aclose(self) -> None:
        self.pool.close()
        await self.client.aclose()


class _Close:
    """A background task that closes an httpx response after the relay finished."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp

    async def __call__(self) -> None:
        await self.resp.aclose()


def make_client(timeout: float) -> httpx.AsyncClient:
    """The pooled httpx client for pass-through paths (low traffic: /v1/models, adapters, ...)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        follow_redirects=False,
        trust_env=False,
    )
