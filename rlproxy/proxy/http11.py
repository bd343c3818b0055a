"""A minimal keep-alive HTTP/1.1 client for the two hot routes (asyncio protocol + httptools/llhttp).

Why not a general client here: measured with `bench/proxy.py --quick` (alternating runs, same
stub), aiohttp's client (3.14, C parser) cost the proxy 0.37-0.50 ms of CPU per request against
0.24-0.29 ms with this one (1.5-1.8x at concurrency 1, ~1.35x at 64, ~1.45x streaming), added
0.36-0.48 ms at p50 instead of 0.21-0.34 ms, and brought 64-concurrent throughput to 0.78-0.86x
direct (0.67-0.78x streaming), under the 0.9x goal. So the hot path keeps this client and proves
it instead: tests/proxy/test_upstream_conformance.py drives it against a raw-socket upstream
through every case below. Every other `/v1/*` path goes over aiohttp (`forward.Upstream.relay`).

What it does, and only that: POST a body on a pooled connection, read the status and headers, then
the body whole or as it arrives (content-length, chunked with extensions and trailers, or framed by
the close; de-chunked by llhttp).
- Interim 1xx responses (100 Continue, 103 Early Hints, ...) are skipped, never taken for the answer.
- Response heads over `max_head` bytes, and anything llhttp cannot parse (a malformed status
  line), fail the request and close the connection.
- No replay: a request is written once. A pooled connection the upstream closed before it is
  used is dropped unused, and idle connections older than `keepalive` are closed (shorter than the
  5 s that uvicorn-based upstreams keep one), so a request is not written into a closing one.
- The pool is capped at `max_connections` open connections; more requests wait for one.
- A body that sends nothing for `idle_timeout` between chunks fails with `BackendTimeout`.

Errors: `BackendUnavailable` / `BackendTimeout` for the body (`Response.next_chunk`); while
connecting and reading the head, plain `OSError`/`ConnectionError` (`forward.Upstream` translates
them, and the caller bounds the time by cancelling the call: `forward._Deadline`).

(Over 400 lines: one protocol and its pool, every case above tested against a raw socket; the
parser's callbacks and the pool's bookkeeping are one state machine.)
"""

from __future__ import annotations

import asyncio
import collections

import httptools

from rlproxy.errors import BackendTimeout, BackendUnavailable

_PAUSE_AT = 1 << 20  # stop reading from the upstream while this much body waits for the client
_NO_BODY = (204, 304)


class ConnectFailed(ConnectionError):
    """No connection could be opened: nothing of the request was sent (safe to send elsewhere)."""


class _Stalled(Exception):
    """The upstream sent nothing for the idle timeout in the middle of a body."""


class _Connection(asyncio.Protocol):
    """One upstream connection: parses responses into status, headers and body chunks."""

    def __init__(self, max_head: int) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.max_head = max_head
        self.closed = False
        self.idle = False  # in the pool, no request outstanding: any byte is a protocol error
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.error: BaseException | None = None
        self.keep_alive = True
        self.waiter: asyncio.Future | None = None
        self.headers_done = False
        self.interim = False  # parsing a 1xx that is to be skipped
        self.until_close = False  # the body ends when the upstream closes the connection
        self.head_bytes = 0  # bytes read while the head was incomplete
        self.header_bytes = 0  # bytes of the header fields parsed
        self.too_big = False
        self.unsolicited = False  # bytes after the complete answer: the connection is out of step
        self.paused = False

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.idle or self.complete:  # nobody asked: never let it answer the next request
            self.unsolicited = True
            self.keep_alive = False
            self.transport.close()
            return
        if not self.headers_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"malformed HTTP response from the upstream: {exc}"))
            return
        if self.unsolicited:  # a second answer in the same read: keep the first, drop the connection
            self.keep_alive = False
            self.transport.close()
        # a head still incomplete after max_head bytes (a trickle), or complete but too big
        if self.too_big or (not self.headers_done and self.head_bytes > self.max_head):
            self._fail(ConnectionError(f"the upstream's response head exceeds {self.max_head} bytes"))
            return
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.headers_done and self.until_close and self.error is None and exc is None:
            self.complete = True  # a body framed by the close: this is its end
        elif not self.complete and self.error is None:
            self.error = ConnectionResetError(
                "the upstream closed the connection" + (f": {exc}" if exc else "")
            )
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._wake()

    # -- httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:
            self.unsolicited = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.headers_done or self.unsolicited:  # a trailer field: hop-by-hop, dropped
            return
        self.header_bytes += len(name) + len(value) + 4
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.unsolicited:
            return
        status = self.parser.get_status_code()
        if self.header_bytes > self.max_head:
            self.too_big = True  # never headers_done: the request fails with the connection
            return
        if 100 <= status < 200 and status != 101:  # interim: llhttp completes it without a body
            self.interim = True
            self.headers = []
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.until_close = status not in _NO_BODY and not any(
            k in (b"content-length", b"transfer-encoding") for k, _ in self.headers
        )
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if self.unsolicited:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _PAUSE_AT and not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True

    def on_message_complete(self) -> None:
        if self.unsolicited:
            return
        if self.interim:  # the real answer follows on the same connection
            self.interim = False
            self.head_bytes = self.header_bytes = 0
            return
        self.complete = True

    # -- the client side ------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def read_headers(self) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def next_chunk(self) -> bytes | None:
        """The body bytes received since the last call; None at the end of the message."""
        while True:
            if self.chunks:
                return self.take()
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self._wait()


class Response:
    """Status, headers and the body of one upstream response (read whole or streamed)."""

    def __init__(self, pool: Pool, conn: _Connection, url: str, idle_timeout: float) -> None:
        self._pool = pool
        self._conn = conn
        self.url = url
        self.idle_timeout = idle_timeout
        self.status_code = conn.status
        self.headers = conn.headers  # lower-case names, raw bytes
        self.content = b""
        self._released = False
        self._timer: asyncio.TimerHandle | None = None  # the idle watchdog, armed by the first wait
        self._since = 0.0  # when the current wait began (loop time)

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool)."""
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def next_chunk(self) -> bytes | None:
        """Body bytes received since the last call; None at the end (the connection is released)."""
        conn = self._conn
        if conn.chunks:
            return conn.take()
        if not conn.complete and conn.error is None:
            loop = asyncio.get_running_loop()
            self._since = loop.time()
            if self._timer is None:  # one timer per idle period, not one per chunk
                self._timer = loop.call_at(self._since + self.idle_timeout, self._watch)
        try:
            chunk = await conn.next_chunk()
        except _Stalled as exc:
            self.close()
            raise BackendTimeout(
                f"upstream {self.url} sent nothing for {self.idle_timeout:g} s in the middle of its answer"
            ) from exc
        except OSError as exc:
            self.close()
            raise BackendUnavailable(f"upstream {self.url} broke off its answer: {exc}") from exc
        if chunk is None:
            self.close()
        return chunk

    def _watch(self) -> None:
        self._timer = None
        conn = self._conn
        if conn.waiter is None or self._released:  # not waiting now: the next wait arms it again
            return
        loop = asyncio.get_running_loop()
        due = self._since + self.idle_timeout
        if loop.time() >= due:
            conn._fail(_Stalled())
        else:
            self._timer = loop.call_at(due, self._watch)

    @property
    def finished(self) -> bool:
        """The whole body has arrived and been taken (the next `next_chunk` returns None)."""
        return self._conn.complete and not self._conn.chunks

    def close(self) -> None:
        """Done with it: a fully read response keeps its connection, a cut one closes it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._released:
            self._released = True
            self._pool._release(self._conn)


class Pool:
    """Keep-alive connections to one host:port, at most `max_connections` open at once."""

    def __init__(
        self,
        host: str,
        port: int,
        ssl: bool = False,
        max_connections: int = 256,
        keepalive: float = 4.0,
        connect_timeout: float = 10.0,
        max_head: int = 64 * 1024,
    ) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl
        self.host_header = f"{host}:{port}".encode()
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self.max_head = max_head
        self._idle: collections.deque[_Connection] = collections.deque()  # oldest first
        self._slots = asyncio.Semaphore(max_connections)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        max_head = self.max_head
        async with asyncio.timeout(self.connect_timeout):
            if self.ssl:
                _, conn = await loop.create_connection(
                    lambda: _Connection(max_head), self.host, self.port, ssl=True, server_hostname=self.host
                )
            else:
                _, conn = await loop.create_connection(lambda: _Connection(max_head), self.host, self.port)
        return conn  # type: ignore[return-value]

    def _pooled(self) -> _Connection | None:
        """The newest idle connection still open and fresh; stale ones are closed unused."""
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self.keepalive:  # this one and every older one
                for old in (conn, *self._idle):
                    if old.transport is not None:
                        old.transport.close()
                self._idle.clear()
                return None
            return conn
        return None

    def _release(self, conn: _Connection) -> None:
        self._slots.release()
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            conn._reset()
            conn.idle = True
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
            return
        conn.closed = True
        if conn.transport is not None:
            conn.transport.close()

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        url: str = "",
        idle_timeout: float = 60.0,
    ) -> Response:
        """Send one request (once) and return when the response headers arrived (the body follows).

        The caller bounds the time (it cancels: `forward._Deadline`); a cancelled wait closes the connection.
        """
        head = [
            method,
            b" ",
            target,
            b" HTTP/1.1\r\nhost: ",
            self.host_header,
            b"\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n",
        ]
        for k, v in headers:
            head += (k, b": ", v, b"\r\n")
        head.append(b"\r\n")
        payload = b"".join(head) + body
        await self._slots.acquire()
        conn = None
        try:
            conn = self._pooled()
            if conn is None:
                try:
                    conn = await self._connect()
                except OSError as exc:  # refused, unreachable, or the connect timeout (TimeoutError)
                    raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc!r}") from exc
            conn.idle = False
            conn.transport.write(payload)
            await conn.read_headers()
        except BaseException as exc:
            if conn is None:
                self._slots.release()
            else:
                conn.keep_alive = False
                self._release(conn)
            if isinstance(exc, RuntimeError):  # uvloop: writing to a closed transport
                raise ConnectionResetError(str(exc)) from exc
            raise
        return Response(self, conn, url, idle_timeout)

    def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
