"""A minimal keep-alive HTTP/1.1 client for the two hot routes (asyncio protocol + httptools).

Why not httpx here: measured on the bench, httpx + httpcore cost ~0.5 ms of CPU per request, and
httpcore's pool scans every connection on each request and release, so 64 concurrent requests cost
~10 ms each; the proxy's goal is <= 1 ms added in total. This client does only what the proxy
needs from its one upstream: send a request with a body on a pooled connection, read the status
and headers, then the body whole or as it arrives (chunked or not, de-chunked by httptools).
httpx still serves every other `/v1/*` path (`forward.Upstream.relay`).

Errors are plain Python ones: `ConnectionError`/`OSError` when the upstream cannot be reached or
drops the connection, `TimeoutError` when it is too slow; `forward.Upstream` translates them.
"""

from __future__ import annotations

import asyncio
import collections

import httptools

_PAUSE_AT = 1 << 20  # stop reading from the upstream while this much body waits for the client


class _Connection(asyncio.Protocol):
    """One upstream connection: parses responses into status, headers and body chunks."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.used = False  # served a request before (a reused connection may be stale)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.got_bytes = False
        self.error: BaseException | None = None
        self.keep_alive = True
        self.waiter: asyncio.Future | None = None
        self.headers_done = False
        self.paused = False

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = ConnectionError(f"malformed HTTP response from the upstream: {exc}")
            self.keep_alive = False
            self.transport.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = ConnectionResetError(
                "the upstream closed the connection" + (f": {exc}" if exc else "")
            )
        self._wake()

    # -- httptools callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _PAUSE_AT and not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True

    def on_message_complete(self) -> None:
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

    def __init__(self, pool: Pool, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self.status_code = conn.status
        self.headers = conn.headers  # lower-case names, raw bytes
        self._released = False

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool)."""
        parts = []
        while (chunk := await self._conn.next_chunk()) is not None:
            parts.append(chunk)
        self._release()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def next_chunk(self) -> bytes | None:
        """Body bytes received since the last call; None at the end (the connection is released)."""
        chunk = await self._conn.next_chunk()
        if chunk is None:
            self._release()
        return chunk

    @property
    def finished(self) -> bool:
        """The whole body has arrived and been taken (the next `next_chunk` returns None)."""
        return self._conn.complete and not self._conn.chunks

    def close(self) -> None:
        """Done with it: a fully read response keeps its connection, a cut one closes it."""
        self._release()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self._pool._release(self._conn)


class Pool:
    """Keep-alive connections to one host:port."""

    def __init__(
        self, host: str, port: int, ssl: bool = False, max_idle: int = 512, connect_timeout: float = 10.0
    ) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl
        self.host_header = f"{host}:{port}".encode()
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            if self.ssl:
                _, conn = await loop.create_connection(
                    _Connection, self.host, self.port, ssl=True, server_hostname=self.host
                )
            else:
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        return conn  # type: ignore[return-value]

    def _release(self, conn: _Connection) -> None:
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            if len(self._idle) < self.max_idle:
                conn._reset()
                self._idle.append(conn)
                return
        conn.closed = True
        if conn.transport is not None:
            conn.transport.close()

    async def request(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Response:
        """Send one request and return once the response headers arrived (the body follows).

        The caller bounds the time (`asyncio.timeout`); a cancelled wait closes the connection.
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
        for attempt in (0, 1):
            conn = None
            while self._idle:
                candidate = self._idle.pop()
                if not candidate.closed and not candidate.transport.is_closing():
                    conn = candidate
                    break
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            conn.used = True
            try:
                conn.transport.write(payload)
                await conn.read_headers()
            except (OSError, RuntimeError) as exc:  # uvloop: RuntimeError on a closed transport
                conn.keep_alive = False
                self._release(conn)
                # a kept-alive connection the upstream closed meanwhile: retry once on a fresh one
                if reused and not conn.got_bytes and attempt == 0:
                    continue
                if isinstance(exc, RuntimeError):
                    raise ConnectionResetError(str(exc)) from exc
                raise
            except BaseException:
                conn.keep_alive = False
                self._release(conn)
                raise
            return Response(self, conn)
        raise ConnectionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
