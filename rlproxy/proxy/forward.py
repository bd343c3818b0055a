"""Forwarding to the upstream; foreign errors are translated here, once.

Two clients, one upstream. The two hot routes go over `http11.Pool` (`Upstream.post`): a small
keep-alive client that costs the proxy 1.5-1.8x less CPU per request than aiohttp's (http11.py
has the measurement), proven by tests/proxy/test_upstream_conformance.py against a raw-socket
upstream (1xx, chunk extensions and trailers, `Connection: close`, stale keep-alive connections,
malformed or oversized heads, drops and stalls). Every other `/v1/*` path goes over one aiohttp
`ClientSession` (`Upstream.relay`, bytes relayed untouched, encoding included), where the rarer
cases (HEAD, 204, 304, any method) are aiohttp's to get right. Both pools are capped at `max_connections`; the
lifespan creates and closes them.

Headers go through minus every hop-by-hop one, both ways: `Connection` and the names it lists,
`Keep-Alive`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`, `Proxy-*`, `Expect` (a client's
`Expect: 100-continue` is ours to answer, never the upstream's), `Host` and `Content-Length`
(recomputed). Capture routes ask for `identity` encoding so the proxy can read and re-emit the body.

Retries: a POST whose bytes may have reached the upstream is never sent again (http11 writes a
request once; aiohttp retries only idempotent methods on a reused connection that dropped). A
pooled connection the upstream closed is dropped before it is used, and idle ones are closed after
`_KEEPALIVE_S`, below the 5 s that uvicorn-based servers (vLLM, the embedded engine) keep an idle
connection, so a request is not written into a connection the upstream is closing.

Errors: a connection that could not be opened becomes `BackendUnreachable` (the request was never
sent: `upstreams.Upstreams` sends it to another replica); other connection failures, protocol
errors (malformed status line, oversized headers) and bodies cut short become `BackendUnavailable`
(502); timeouts `BackendTimeout` (504), raised `from` the foreign error with the URL in the message.

Several upstreams (`--upstream` repeated): `upstreams.Upstreams` holds one `Upstream` per replica
and has the same `post`/`relay`/`aclose`; a single upstream is this class alone, as before.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote, urlsplit

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from yarl import URL

from rlproxy.errors import (
    BackendError,
    BackendRedirect,
    BackendTimeout,
    BackendUnavailable,
    BackendUnreachable,
)
from rlproxy.proxy import http11
from rlproxy.proxy.errors import upstream_failure

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
_FAILURE_LOGGED = 64 * 1024  # of a relayed 5xx body, what is read for the log
# aiohttp adds these unless told not to; the client's own (if any) are forwarded instead
_SKIP_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def _listed(raw: list[tuple[bytes, bytes]]) -> set[bytes]:
    """Header names a `Connection` header lists (hop-by-hop by declaration), lower-case."""
    names: set[bytes] = set()
    for k, v in raw:
        if k == b"connection":
            names.update(n.strip().lower() for n in v.split(b","))
    return names


def _strip(raw: list[tuple[bytes, bytes]], drop: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """`raw` minus hop-by-hop headers and `drop`. Names come lower-case (ASGI's, http11's, and
    the relay's, which lowers aiohttp's): this runs twice per request, on every header."""
    listed = _listed(raw)
    out = []
    for k, v in raw:
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


class _Deadline:
    """What `async with asyncio.timeout(seconds)` does around the hot routes' upstream call, with one
    timer and no context manager: about half of `asyncio.timeout`'s CPU (its Timeout object, a
    coroutine each to enter and exit, two loop lookups; 7.3 vs 3.7 us a call on uvloop, issue 24).
    When the time passes the task is cancelled; the caller asks `passed(exc)` of the exception
    it caught: True when that is the deadline's cancel and no other (then it is a timeout), as
    asyncio.timeout decides it (the task's cancel count from before the call)."""

    __slots__ = ("task", "base", "expired", "timer")

    def __init__(self, seconds: float) -> None:
        task = asyncio.current_task()
        assert task is not None  # a request's task
        self.task = task
        self.base = task.cancelling()
        self.expired = False
        loop = task.get_loop()
        self.timer = loop.call_at(loop.time() + seconds, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.task.cancel()

    def passed(self, exc: BaseException) -> bool:
        return self.expired and isinstance(exc, asyncio.CancelledError) and self.task.uncancel() <= self.base


class Upstream:
    """The upstream server: the hot routes over `http11.Pool`, everything else over aiohttp.

    Create it (and `aclose` it) in the lifespan. `max_connections` caps each pool: more concurrent
    requests wait for a free connection (within their timeout). `timeout` bounds a whole
    non-streaming answer and the wait for a stream's headers; `idle_timeout` bounds each gap
    between a stream's chunks. `api_key` (the engine's secret) goes on every request; the client's
    own `Authorization` never does.
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
        url = urlsplit(self.base_url)
        tls = url.scheme == "https"
        self.prefix = url.path.rstrip("/").encode()
        self.pool = http11.Pool(
            url.hostname or "127.0.0.1",
            url.port or (443 if tls else 80),
            ssl=tls,
            max_connections=max_connections,
            keepalive=_KEEPALIVE_S,
            connect_timeout=min(timeout, _CONNECT_S),
        )
        self._auth = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        connector = aiohttp.TCPConnector(
            limit=max_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S, use_dns_cache=True
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            # sock_read: the wait for the head and each gap in the body
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=min(timeout, _CONNECT_S), sock_read=timeout
            ),
            auto_decompress=False,
            skip_auto_headers=_SKIP_AUTO,
            cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            trust_env=False,
        )

    @classmethod
    def of(cls, url: str, settings, api_key: str | None) -> Upstream:
        """One for `url` with the settings' `upstream_*` timeouts and pool size."""
        s = settings
        return cls(url, s.upstream_timeout, s.upstream_idle_timeout, s.upstream_max_connections, api_key)

    async def post(
        self, path: bytes, headers: list, body: bytes, query: bytes, stream: bool, run_id: str | None = None
    ) -> http11.Response:
        """POST to the upstream; a non-streaming response is read whole (into `.content`).

        `run_id` is for `upstreams.Upstreams` (which replica); one upstream has no choice to make.
        """
        target = self.prefix + path + (b"?" + query if query else b"")
        url = self.base_url + path.decode("latin-1")
        resp = None
        deadline = _Deadline(self.timeout)
        try:
            resp = await self.pool.request(
                b"POST", target, headers + self._auth, body, url, self.idle_timeout
            )
            if not stream:
                resp.content = await resp.read()
        except BaseException as exc:
            if resp is not None:
                resp.close()
            if deadline.passed(exc):
                raise self._translate(TimeoutError(), path.decode("latin-1")) from None
            ours = self._translate(exc, path.decode("latin-1"))
            if ours is exc:
                raise
            raise ours from exc
        finally:
            deadline.timer.cancel()
        return resp

    def _translate(self, exc: BaseException, path: str) -> BaseException:
        """Our error for a foreign one (anything else is returned as it is, to be re-raised)."""
        if isinstance(exc, BackendError):
            return exc
        if isinstance(exc, http11.ConnectFailed | aiohttp.ClientConnectorError):
            # nothing was sent: another replica may take it
            return BackendUnreachable(f"upstream {self.base_url}{path} is unreachable: {exc}")
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
        if 300 <= raw.status < 400 and "Location" in raw.headers:
            raw.close()  # a redirect names the engine's address: never relayed, never followed
            raise BackendRedirect(
                f"the upstream answered {path} with a redirect ({raw.status}); redirects are not "
                "relayed: use the route's canonical path"
            )
        headers_out = response_headers([(k.lower(), v) for k, v in raw.raw_headers], _RELAY_DROP)
        if raw.status >= 500:  # never its body (a traceback, paths): proxy/errors.py `upstream_failure`
            try:
                failed = await raw.content.read(_FAILURE_LOGGED)
            except (aiohttp.ClientError, OSError):
                failed = b""
            finally:
                raw.close()
            headers_out = [(k, v) for k, v in headers_out if k != b"content-length"]
            body, headers_out = upstream_failure(raw.status, failed, headers_out)
            out = Response(body, status_code=raw.status)
            out.raw_headers = [*headers_out, (b"content-length", str(len(body)).encode())]
            return out
        if raw.status in _NO_BODY:
            headers_out = [(k, v) for k, v in headers_out if k != b"content-length"]
        out = StreamingResponse(self._body(raw, path), status_code=raw.status)
        out.raw_headers = headers_out
        return out

    async def _body(self, raw: aiohttp.ClientResponse, path: str):
        """The relayed body as it arrives; a body cut short raises (the client's response is cut too).

        However the relay ends (done, client gone, upstream broke), the connection is handed back
        or closed when the generator is closed.
        """
        try:
            async for chunk in raw.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError) as exc:
            raise self._translate(exc, path) from exc
        finally:
            if raw.content.at_eof():
                raw.release()
            else:
                raw.close()

    async def aclose(self) -> None:
        self.pool.close()
        await self.session.close()
