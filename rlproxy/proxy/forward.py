"""Forwarding to the upstream over one pooled aiohttp client; foreign errors are translated here, once.

Why aiohttp: the upstream hop is a conformance problem first (1xx interim responses, chunk
extensions and trailers, `Connection: close`, stale keep-alive connections, malformed or oversized
heads), and aiohttp's client does all of it with a C parser (llhttp) for about the CPU per request
of a hand-written client (bench/README.md has the measurement). One `ClientSession` with a capped
`TCPConnector` serves both the two hot routes (`Upstream.post`) and every other `/v1/*` path
(`Upstream.relay`, bytes relayed untouched, encoding included); the lifespan creates and closes it.

Headers go through minus every hop-by-hop one, both ways: `Connection` and the names it lists,
`Keep-Alive`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`, `Proxy-*`, `Expect` (a client's
`Expect: 100-continue` is ours to answer, never the upstream's), `Host` and `Content-Length`
(recomputed). Capture routes ask for `identity` encoding so the proxy can read and re-emit the body.

Retries: a POST whose bytes may have reached the upstream is never sent again (aiohttp retries only
idempotent methods on a reused connection that dropped). The connector drops a pooled connection the
upstream closed before it is used, and closes idle ones after `_KEEPALIVE_S`, below the 5 s that
uvicorn-based servers (vLLM, the embedded engine) keep an idle connection, so a request is not
written into a connection the upstream is closing.

Errors: connection failures, protocol errors (malformed status line, oversized headers) and bodies
cut short become `BackendUnavailable` (502); timeouts `BackendTimeout` (504), raised `from` the
foreign error with the URL in the message.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from yarl import URL

from rlproxy.errors import BackendError, BackendTimeout, BackendUnavailable

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"expect",
        b"host",
        b"content-length",
    }
)
# uvicorn writes its own `server` and `date`; the body we send may differ from the upstream's
_RESPONSE_DROP = HOP_BY_HOP | {b"server", b"date", b"content-encoding"}
# the relay sends the upstream's bytes as they are, so their length still holds
_RELAY_DROP = (HOP_BY_HOP - {b"content-length"}) | {b"server", b"date"}
_NO_BODY = frozenset({204, 304})
_KEEPALIVE_S = 4.0  # below uvicorn's default 5 s keep-alive: we close an idle connection first
_CONNECT_S = 10.0
# aiohttp adds these unless told not to; the client's own (if any) are forwarded instead
_SKIP_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def _listed(raw: list[tuple[bytes, bytes]]) -> set[bytes]:
    """Header names a `Connection` header lists (hop-by-hop by declaration), lower-case."""
    names: set[bytes] = set()
    for k, v in raw:
        if k.lower() == b"connection":
            names.update(n.strip().lower() for n in v.split(b","))
    return names


def _strip(raw: list[tuple[bytes, bytes]], drop: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """`raw` minus hop-by-hop headers and `drop`, names lower-cased."""
    listed = _listed(raw)
    out = []
    for k, v in raw:
        k = k.lower()
        if k in drop or k in listed or k.startswith(b"proxy-"):
            continue
        out.append((k, v))
    return out


def request_headers(raw: list[tuple[bytes, bytes]], drop: frozenset[bytes], identity: bool) -> list:
    """Client headers to send upstream (`drop` adds names to leave out, lower-case bytes)."""
    out = _strip(raw, HOP_BY_HOP | drop)
    if identity:
        out = [(k, v) for k, v in out if k != b"accept-encoding"]
        out.append((b"accept-encoding", b"identity"))
    return out


def response_headers(raw: list[tuple[bytes, bytes]], drop: frozenset[bytes] = _RESPONSE_DROP) -> list:
    """Upstream response headers to hand the client (raw ASGI pairs, names lower-cased)."""
    return _strip(raw, drop)


def _str_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """aiohttp takes str headers and writes them as UTF-8: decoding as UTF-8 keeps the bytes exact
    (a value that is not UTF-8 is the rare exception, sent as its Latin-1 reading)."""
    out = []
    for k, v in headers:
        try:
            value = v.decode()
        except UnicodeDecodeError:
            value = v.decode("latin-1")
        out.append((k.decode("latin-1"), value))
    return out


class UpstreamResponse:
    """Status, headers and body of one upstream response (read whole or chunk by chunk).

    Body errors are ours already: a body cut short is `BackendUnavailable`, a body that stalls for
    longer than `idle_timeout` between chunks is `BackendTimeout`.
    """

    __slots__ = ("raw", "status_code", "headers", "content", "url", "idle_timeout")

    def __init__(self, raw: aiohttp.ClientResponse, url: str, idle_timeout: float) -> None:
        self.raw = raw
        self.url = url
        self.idle_timeout = idle_timeout
        self.status_code = raw.status
        self.headers = [(k.lower(), v) for k, v in raw.raw_headers]  # lower-case names, raw bytes
        self.content = b""

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool); each chunk within the idle timeout."""
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        self.close()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def next_chunk(self) -> bytes | None:
        """Body bytes received since the last call; None at the end of the body."""
        content = self.raw.content
        try:
            async with asyncio.timeout(self.idle_timeout):
                data = await content.readany()
        except TimeoutError as exc:
            raise BackendTimeout(
                f"upstream {self.url} sent nothing for {self.idle_timeout:g} s in the middle of its answer"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise BackendUnavailable(f"upstream {self.url} broke off its answer: {exc!r}") from exc
        return data or None

    @property
    def finished(self) -> bool:
        """The whole body has arrived and been taken (the next `next_chunk` returns None)."""
        return self.raw.content.at_eof()

    def close(self) -> None:
        """Done with it: a fully read response keeps its connection, a cut one closes it."""
        if self.raw.content.at_eof():
            self.raw.release()
        else:
            self.raw.close()


class Upstream:
    """The upstream server behind one pooled aiohttp session (create and close it in the lifespan).

    `max_connections` caps the pool: more concurrent requests wait for a free connection (within
    their timeout). `timeout` bounds a whole non-streaming answer and the wait for a stream's
    headers; `idle_timeout` bounds each gap between a stream's chunks.
    """

    def __init__(
        self,
        base_url: str,
        timeout: float,
        idle_timeout: float = 60.0,
        max_connections: int = 256,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        connector = aiohttp.TCPConnector(
            limit=max_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S, use_dns_cache=True
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(timeout, _CONNECT_S)),
            auto_decompress=False,
            skip_auto_headers=_SKIP_AUTO,
            cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
            # the engine's key on every request (the client's own Authorization is always dropped)
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            trust_env=False,
        )
        self._urls: dict[bytes, URL] = {}

    def _url(self, path: bytes, query: bytes) -> URL:
        if not query:
            url = self._urls.get(path)
            if url is None:
                url = self._urls[path] = URL(self.base_url + path.decode("latin-1"), encoded=True)
            return url
        return URL(self.base_url + path.decode("latin-1") + "?" + query.decode("latin-1"), encoded=True)

    async def post(
        self, path: bytes, headers: list, body: bytes, query: bytes, stream: bool
    ) -> UpstreamResponse:
        """POST to the upstream; a non-streaming response is read whole (into `.content`)."""
        url = self._url(path, query)
        resp: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(self.timeout):
                raw = await self.session.post(
                    url, data=body, headers=_str_headers(headers), allow_redirects=False
                )
                resp = UpstreamResponse(raw, self.base_url + path.decode("latin-1"), self.idle_timeout)
                if not stream:  # the whole answer within `timeout` (no per-chunk deadline to arm)
                    resp.content = await raw.read()
                    raw.release()
        except BaseException as exc:
            if resp is not None:
                resp.raw.close()
            ours = self._translate(exc, path.decode("latin-1"))
            if ours is exc:
                raise
            raise ours from exc
        return resp

    def _translate(self, exc: BaseException, path: str) -> BaseException:
        """Our error for a foreign one (anything else is returned as it is, to be re-raised)."""
        if isinstance(exc, BackendError):
            return exc
        if isinstance(exc, TimeoutError):  # aiohttp's timeouts are TimeoutErrors too
            return BackendTimeout(f"upstream {self.base_url}{path} did not answer within {self.timeout:g} s")
        if isinstance(exc, aiohttp.ClientResponseError):  # the parser refused what it got
            return BackendUnavailable(
                f"upstream {self.base_url}{path} sent a malformed response: {exc.status}, {exc.message}"
            )
        if isinstance(exc, (aiohttp.ClientError, OSError)):
            return BackendUnavailable(f"upstream {self.base_url}{path} is unreachable: {exc!r}")
        return exc

    async def relay(self, request: Request, path: str, drop: frozenset[bytes]) -> Response:
        """Pass any other request through untouched, streaming the answer back as it comes."""
        body = await request.body()
        headers = request_headers(request.scope["headers"], drop, identity=False)
        url = self.base_url + quote(path, safe="/:@!$&'()*+,;=-._~")
        query = request.scope.get("query_string", b"")
        if query:
            url += "?" + query.decode("latin-1")
        try:
            async with asyncio.timeout(self.timeout):
                raw = await self.session.request(
                    request.method,
                    URL(url, encoded=True),
                    data=body or None,
                    headers=_str_headers(headers),
                    allow_redirects=False,
                )
        except BaseException as exc:
            ours = self._translate(exc, path)
            if ours is exc:
                raise
            raise ours from exc
        resp = UpstreamResponse(raw, url, self.timeout)
        headers_out = response_headers(resp.headers, _RELAY_DROP)
        if resp.status_code in _NO_BODY:
            headers_out = [(k, v) for k, v in headers_out if k != b"content-length"]
        out = StreamingResponse(_body(resp), status_code=resp.status_code)
        out.raw_headers = headers_out
        return out

    async def aclose(self) -> None:
        await self.session.close()


async def _body(resp: UpstreamResponse):
    """The relayed body as it arrives; a body cut short raises (the client's response is cut too).

    However the relay ends (done, client gone, upstream broke), the connection is handed back or
    closed when the generator is closed.
    """
    try:
        while (chunk := await resp.next_chunk()) is not None:
            yield chunk
    finally:
        resp.close()
