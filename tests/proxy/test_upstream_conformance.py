"""The proxy's upstream hop against a raw-socket upstream that writes exact bytes (issue 9).

Pins the part "the upstream client is a conformance problem": 1xx and `Expect: 100-continue`
(responses crossing between clients), chunked bodies with extensions and trailers,
`Connection: close`, an upstream closing a kept-alive connection between requests, an upstream
closing after reading a request (no silent replay of a POST), mid-stream drops and stalls, a stream
cut by the proxy's shutdown, SSE events framed by CRLF, CR or both (split anywhere, `data:`
without its space, through a trainable and a hosted policy), an event that never ends, malformed
status lines, oversized headers, HEAD/204/304 on the
pass-through path, and hop-by-hop headers in both directions. Each test drives a real proxy under
uvicorn on a loopback port; the upstream records every request it read, with the connection it
came on, so "exactly once" and "same connection" are counted, not assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

MODEL = "stub-model"
CHAT = "/v1/chat/completions"


@dataclass
class Req:
    conn: int  # which upstream connection it came on (1, 2, ...)
    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    def json(self) -> dict:
        return orjson.loads(self.body)


# a handler writes the answer to one request; it returns "close" to close the connection after it
Handler = Callable[[Req, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[str | None]]


@dataclass
class RawUpstream:
    """An asyncio server that parses requests by hand and answers with whatever bytes a test says."""

    handler: Handler | None = None
    requests: list[Req] = field(default_factory=list)
    port: int = 0
    _conns: itertools.count = field(default_factory=lambda: itertools.count(1))
    _writers: set = field(default_factory=set)
    _tasks: set = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def completions(self) -> list[Req]:
        return [r for r in self.requests if r.path.split(b"?")[0] == CHAT.encode()]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = next(self._conns)
        self._writers.add(writer)
        self._tasks.add(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head[:-4].split(b"\r\n")
                method, path, _ = lines[0].split(b" ", 2)
                headers = []
                for line in lines[1:]:
                    k, _, v = line.partition(b":")
                    headers.append((k.strip().lower(), v.strip()))
                req = Req(conn, method, path, headers, b"")
                n = int(req.header(b"content-length") or 0)
                req.body = await reader.readexactly(n) if n else b""
                self.requests.append(req)
                if method == b"GET" and path in (b"/v1/models", b"/health"):  # the backend's attach
                    body = orjson.dumps({"object": "list", "data": [{"id": MODEL, "parent": None}]})
                    writer.write(response(200, body))
                    continue
                assert self.handler is not None, f"no handler for {method!r} {path!r}"
                if await self.handler(req, reader, writer) == "close":
                    await writer.drain()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            self._tasks.discard(asyncio.current_task())
            writer.close()


def response(status: int, body: bytes, extra: bytes = b"", reason: bytes = b"OK") -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
        % (status, reason, len(body), extra)
    ) + body


def ids_for(req: Req) -> list[int]:
    """Token ids that name the request they answer: max_tokens n -> [1000n, 1000n+1, ...]."""
    n = req.json().get("max_tokens", 3)
    return [1000 * n + t for t in range(n)]


def completion(req: Req) -> bytes:
    """A vLLM-style chat completion for `req`, its token ids derived from the request."""
    ids = ids_for(req)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": " ".join(f"t{t}" for t in ids)},
        "logprobs": {"content": [{"token": f"t{t}", "logprob": -0.5, "top_logprobs": []} for t in ids]},
        "finish_reason": "length",
        "token_ids": ids,
    }
    usage = {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)}
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": MODEL, "choices": [choice]}
    return orjson.dumps({**body, "usage": usage, "prompt_token_ids": [1, 2, 3]})


def sse_events(req: Req) -> list[bytes]:
    """The SSE events of a streamed chat completion for `req` (one token per event)."""
    ids = ids_for(req)
    out = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        delta = {"role": "assistant", "content": f"t{t} "} if i == 0 else {"content": f"t{t} "}
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": {"content": [{"token": f"t{t}", "logprob": -0.5, "top_logprobs": []}]},
            "finish_reason": "length" if last else None,
            "token_ids": [t],
        }
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
        chunk["choices"] = [choice]
        if i == 0:
            chunk["prompt_token_ids"] = [1, 2, 3]
        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


def chunk(data: bytes, ext: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(data), ext, data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def answer(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str | None:
    """The well-behaved default: a full completion, or a chunked SSE stream."""
    if req.json().get("stream"):
        writer.write(SSE_HEAD + b"".join(chunk(e) for e in sse_events(req)) + b"0\r\n\r\n")
    else:
        writer.write(response(200, completion(req)))
    return None


@pytest.fixture
def upstream(loop_thread):
    up = RawUpstream(handler=answer)
    loop_thread.run(up.start())
    yield up
    loop_thread.run(up.stop())


@pytest.fixture
def proxy(make_proxy, upstream):
    return make_proxy(upstream.url, upstream_timeout=5.0, upstream_idle_timeout=1.0)


def post(proxy, max_tokens: int, run_id: str = "run-a", stream: bool = False, **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    headers = {"X-Run-Id": run_id, **kw.pop("headers", {})}
    return httpx.post(proxy.url + CHAT, json=body, headers=headers, timeout=10, **kw)


def rows(proxy) -> list[dict]:
    """Stored completions in order, JSON columns decoded."""
    cols = ("run_id", "request", "token_ids", "status", "status_code", "error", "finish_reason")
    out = []
    for r in proxy.query(f"SELECT {', '.join(cols)} FROM completions ORDER BY created_at, id"):
        d = dict(zip(cols, r, strict=True))
        for k in ("request", "token_ids"):
            d[k] = json.loads(d[k]) if isinstance(d[k], str) else d[k]
        out.append(d)
    return out


def assert_own_tokens(proxy, sizes: list[int]) -> None:
    """Each stored row carries the tokens of its own request (none crossed)."""
    stored = rows(proxy)
    assert [r["request"]["max_tokens"] for r in stored] == sizes
    for r in stored:
        n = r["request"]["max_tokens"]
        assert r["status"] == "ok" and r["token_ids"] == [[1000 * n + t for t in range(n)]], r


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def raw_request(port: int, data: bytes, expect_continue: bool = False) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request over a plain socket (the headers and body exactly as given).

    With `expect_continue` the body is held back until the server says `100 Continue` (what curl
    does for a large body); returns the final status, headers and the body (content-length framed).
    """
    data = data.replace(b"host: x\r\n", b"host: 127.0.0.1:%d\r\n" % port)  # an allowed Host
    head, _, body = data.partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + b"\r\n\r\n" + (b"" if expect_continue else body))
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                got = s.recv(65536)
                assert got, f"connection closed early: {buf!r}"
                buf += got
            resp_head, _, buf = buf.partition(b"\r\n\r\n")
            status = int(resp_head.split(b" ", 2)[1])
            if status == 100:
                assert expect_continue
                s.sendall(body)
                continue
            headers = {}
            for line in resp_head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip()
            n = int(headers.get(b"content-length", b"0"))
            while len(buf) < n:
                buf += s.recv(65536)
            return status, headers, buf[:n]


# ---- 1xx: the crossed responses of the issue ---------------------------------------------------


async def uvicorn_like(req: Req, reader, writer) -> str | None:
    """What uvicorn (vLLM, the embedded engine) does: `100 Continue` when the request expects it."""
    if req.header(b"expect") == b"100-continue":  # on its own, before the app has answered
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
    return await answer(req, reader, writer)


def test_expect_100_continue_never_crosses_responses(proxy, upstream):
    """Case 1 of the issue: a client sends `Expect: 100-continue`; the next requests on the same
    pooled upstream connection must each get their own response, and each row its own tokens."""
    upstream.handler = uvicorn_like
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-run-id: run-a\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    status, _, got = raw_request(proxy.port, req, expect_continue=True)
    assert status == 200
    assert orjson.loads(got)["choices"][0]["message"]["content"] == "t2000 t2001"
    sizes = [2]
    for n in (4, 6, 8, 10):
        resp = post(proxy, n, run_id=f"run-{n}")
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"][0]["message"]["content"].split()) == n
        sizes.append(n)
    assert len({r.conn for r in upstream.completions()}) == 1  # all on one pooled connection
    assert_own_tokens(proxy, sizes)
    assert all(r.header(b"expect") is None for r in upstream.requests)


@pytest.mark.parametrize("interim", [b"100 Continue", b"102 Processing", b"103 Early Hints\r\nlink: </a>"])
def test_interim_1xx_before_the_answer_is_skipped(proxy, upstream, interim):
    """An upstream that sends an interim 1xx (unasked) before the real answer: skipped, no crossing."""

    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.1 " + interim + b"\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # a separate write: the 1xx alone is all the proxy has read
        return await answer(req, reader, writer)

    upstream.handler = handler
    for n in (1, 2, 3):
        resp = post(proxy, n)
        assert resp.status_code == 200 and len(resp.json()["choices"][0]["message"]["content"].split()) == n
    stream = post(proxy, 4, stream=True)
    assert stream.status_code == 200 and stream.text.count("data: ") == 5
    assert_own_tokens(proxy, [1, 2, 3, 4])


@pytest.mark.parametrize("when", ["same-write", "later"])
def test_unsolicited_answer_never_reaches_the_next_request(proxy, upstream, when):
    """An upstream that answers one request twice (in the same write, or a moment later while the
    connection idles in the pool): the extra answer is dropped with its connection, and every
    following request gets its own response (the crossing of issue case 1, from the other side)."""

    async def handler(req, reader, writer):
        writer.write(response(200, completion(req)))
        if req.json()["max_tokens"] == 1:
            if when == "later":
                await writer.drain()
                await asyncio.sleep(0.1)
            writer.write(response(200, completion(req)))
        return None

    upstream.handler = handler
    assert post(proxy, 1).status_code == 200
    time.sleep(0.3)
    for n in (2, 3):
        resp = post(proxy, n)
        assert resp.status_code == 200 and len(resp.json()["choices"][0]["message"]["content"].split()) == n
    assert_own_tokens(proxy, [1, 2, 3])


# ---- framing: chunked with extensions and trailers, Connection: close ------------------------


def test_chunked_with_extensions_and_trailers(proxy, upstream):
    """Chunk extensions and trailers, streamed and not; the connection stays usable after them."""

    async def handler(req, reader, writer):
        trailer = b"0\r\nx-checksum: abc\r\nx-other: 1\r\n\r\n"
        if req.json().get("stream"):
            events = b"".join(chunk(e, b';ext="a b";n=1') for e in sse_events(req))
            writer.write(SSE_HEAD[:-2] + b"trailer: x-checksum, x-other\r\n\r\n" + events + trailer)
        else:
            body = completion(req)
            parts = [body[:7], body[7:20], body[20:]]
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
                b"trailer: x-checksum\r\n\r\n" + b"".join(chunk(p, b";foo=bar") for p in parts) + trailer
            )
        return None

    upstream.handler = handler
    a, b = post(proxy, 3), post(proxy, 5, stream=True)
    c = post(proxy, 7)
    assert a.status_code == b.status_code == c.status_code == 200
    assert a.json()["choices"][0]["message"]["content"] == "t3000 t3001 t3002"
    assert b.text.count("data: ") == 6 and b.text.endswith("data: [DONE]\n\n")
    assert "x-checksum" not in a.headers and "trailer" not in b.headers
    assert len({r.conn for r in upstream.completions()}) == 1
    assert_own_tokens(proxy, [3, 5, 7])


@pytest.mark.parametrize("framing", ["content-length", "until-close"])
def test_connection_close_responses(proxy, upstream, framing):
    """`Connection: close` answers (framed by length, or by the close itself): each request is
    answered from its own connection, exactly once."""

    async def handler(req, reader, writer):
        body = completion(req)
        if framing == "content-length":
            writer.write(response(200, body, b"connection: close\r\n"))
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n" + body
            )
        return "close"

    upstream.handler = handler
    for n in (1, 2, 3):
        resp = post(proxy, n)
        assert resp.status_code == 200 and len(resp.json()["choices"][0]["message"]["content"].split()) == n
    assert [r.conn for r in upstream.completions()] == sorted({r.conn for r in upstream.completions()})
    assert len(upstream.completions()) == 3
    assert_own_tokens(proxy, [1, 2, 3])


def test_upstream_closing_an_idle_keepalive_connection(proxy, upstream):
    """The upstream closes a kept-alive connection between requests (its keep-alive timeout): the
    next request succeeds on a fresh connection and reaches the upstream exactly once."""

    async def handler(req, reader, writer):
        await answer(req, reader, writer)
        await writer.drain()
        await asyncio.sleep(0.2)  # then close while idle, as uvicorn does after its keep-alive timeout
        return "close"

    upstream.handler = handler
    assert post(proxy, 1).status_code == 200
    time.sleep(0.6)
    assert post(proxy, 2).status_code == 200
    first, second = upstream.completions()  # exactly once each
    assert first.conn != second.conn
    assert_own_tokens(proxy, [1, 2])


@pytest.mark.parametrize("reused", [False, True])
def test_upstream_closing_after_reading_the_request_is_502_not_replayed(proxy, upstream, reused):
    """The upstream reads a POST and closes without answering (on a fresh or a kept-alive
    connection): 502 in OpenAI's shape, the failure stored, and the POST never sent twice."""

    async def handler(req, reader, writer):
        if req.json()["max_tokens"] == 9:
            return "close"
        return await answer(req, reader, writer)

    upstream.handler = handler
    if reused:
        assert post(proxy, 1).status_code == 200
    err = assert_openai_error(post(proxy, 9), 502)
    assert err["code"] == "upstream_unavailable"
    time.sleep(0.3)  # a replay would arrive by now
    assert [r.json()["max_tokens"] for r in upstream.completions()].count(9) == 1
    stored = rows(proxy)[-1]
    assert (
        stored["request"]["max_tokens"] == 9 and stored["status"] == "error" and stored["status_code"] == 502
    )


# ---- broken answers: malformed, oversized, cut, stalled ----------------------------------------


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 2x0 OK\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1\r\n\r\n",
        b"NOT-HTTP garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nbad header line\r\n\r\n{}",
    ],
    ids=["status-not-a-number", "no-status", "not-http", "header-without-colon"],
)
def test_malformed_response_is_502_and_stored(proxy, upstream, head):
    """A malformed status line or head: 502 in OpenAI's shape, the failed completion stored."""

    async def handler(req, reader, writer):
        writer.write(head)
        return "close"

    upstream.handler = handler
    assert_openai_error(post(proxy, 3), 502)
    stored = rows(proxy)
    assert len(stored) == 1 and stored[0]["status"] == "error" and stored[0]["status_code"] == 502


@pytest.mark.parametrize("size", [100_000, 1_000_000])
def test_oversized_response_headers_are_502_and_stored(proxy, upstream, size):
    """Response headers far over any sane size: 502, stored; the proxy does not buffer them whole."""

    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nx-huge: " + b"a" * size + b"\r\ncontent-length: 2\r\n\r\n{}")
        return "close"

    upstream.handler = handler
    assert_openai_error(post(proxy, 3), 502)
    assert rows(proxy)[0]["status_code"] == 502
    upstream.handler = answer  # the next request is served normally
    assert post(proxy, 2).status_code == 200


def test_body_cut_short_is_502_and_stored(proxy, upstream):
    """A non-streaming body shorter than its content-length, then the connection closed."""

    async def handler(req, reader, writer):
        body = completion(req)
        writer.write(response(200, body)[: -len(body) // 2])
        return "close"

    upstream.handler = handler
    assert_openai_error(post(proxy, 3), 502)
    assert rows(proxy)[0]["status"] == "error" and rows(proxy)[0]["status_code"] == 502


def stream_events(proxy, n: int) -> tuple[list[str], Exception | None]:
    """Read a streamed completion through the proxy; the events read and the error that cut it."""
    events: list[str] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "stream": True}
    try:
        with httpx.stream("POST", proxy.url + CHAT, json=body, headers={"X-Run-Id": "r"}, timeout=10) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
    except httpx.HTTPError as exc:
        return events, exc
    return events, None


def test_mid_stream_drop_is_stored_as_error_and_the_client_can_tell(proxy, upstream):
    """The upstream drops the connection after two events: the row is `error` (502), and the
    client's stream ends broken (no terminating chunk), never like a clean end."""

    async def handler(req, reader, writer):
        writer.write(SSE_HEAD + b"".join(chunk(e) for e in sse_events(req)[:2]))
        await writer.drain()
        return "close"

    upstream.handler = handler
    events, error = stream_events(proxy, 5)
    assert len(events) == 2
    assert isinstance(error, httpx.RemoteProtocolError), error
    stored = rows(proxy)
    assert len(stored) == 1 and stored[0]["status"] == "error" and stored[0]["status_code"] == 502
    assert "broke" in stored[0]["error"]
    assert stored[0]["token_ids"] == [[5000, 5001]]  # what did arrive is kept


def _framed(events: list[bytes], style: str) -> list[bytes]:
    """`events` (LF-framed, one per write) as an upstream of `style` writes them: lines ended by
    CRLF (sse-starlette's default, which many OpenAI-compatible servers use), by CR, a different
    ending per event, CRLF with every write ending between the separator's CR and LF, `data:`
    without its optional space, each value over two `data:` lines, or a byte order mark first."""
    if style == "crlf":
        return [e.replace(b"\n", b"\r\n") for e in events]
    if style == "cr":
        return [e.replace(b"\n", b"\r") for e in events]
    if style == "mixed":
        return [e.replace(b"\n", (b"\n", b"\r\n", b"\r")[i % 3]) for i, e in enumerate(events)]
    if style == "crlf-split":
        crlf = [e.replace(b"\n", b"\r\n") for e in events]
        return [(b"\n" if i else b"") + e[:-1] for i, e in enumerate(crlf)] + [b"\n"]
    if style == "bom":  # a UTF-8 byte order mark before the first event (SSE ignores it)
        return [b"\xef\xbb\xbf" + events[0], *events[1:]]
    if style == "multi-line":  # each JSON value over two data lines (SSE joins them with a LF)
        split = [e.replace(b',"', b',\ndata: "', 1) if e.startswith(b"data: {") else e for e in events]
        assert all(e.count(b"data:") == 2 for e in split[:-1]), split
        return split
    assert style == "no-space"
    return [e.replace(b"data: ", b"data:") for e in events]


@pytest.mark.parametrize("style", ["crlf", "cr", "mixed", "crlf-split", "no-space", "multi-line", "bom"])
def test_every_sse_line_ending_is_relayed_event_by_event(proxy, upstream, style):
    """SSE ends a line with CRLF, LF or CR, `data:` may lack its space, and an event's value may
    span several `data:` lines (joined by LF). Each event reaches the
    client as it arrives (the upstream holds the rest until the client has read the first: a relay
    that waited for LF LF held the whole stream to its end), and the row holds every token."""
    seen = threading.Event()
    held: list[bool] = []

    async def handler(req, reader, writer):
        pieces = _framed(sse_events(req), style)
        writer.write(SSE_HEAD + chunk(pieces[0]))
        await writer.drain()
        for _ in range(100):  # up to 5 s for the client to read the first event
            if seen.is_set():
                break
            await asyncio.sleep(0.05)
        held.append(seen.is_set())
        writer.write(b"".join(chunk(p) for p in pieces[1:]) + b"0\r\n\r\n")

    upstream.handler = handler
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    texts, done = [], False
    with httpx.stream("POST", proxy.url + CHAT, json=body, headers={"X-Run-Id": "sse"}, timeout=10) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[6:] if line.startswith("data: ") else line[5:]  # the space is optional
            if data.startswith("{"):
                seen.set()
                texts.append(orjson.loads(data)["choices"][0]["delta"].get("content") or "")
            done = done or data == "[DONE]"
    assert held == [True], "the first event reached the client only after the upstream's last"
    assert "".join(texts) == "t5000 t5001 t5002 t5003 t5004 " and done
    (row,) = rows(proxy)
    assert (row["status"], row["token_ids"]) == ("ok", [[5000, 5001, 5002, 5003, 5004]])


@pytest.mark.parametrize("style", ["crlf", "cr"])
def test_a_hosted_stream_of_other_line_ends_goes_as_sent_and_is_stored_whole(make_proxy, upstream, style):
    """A hosted (text-only) policy relays the provider's bytes untouched; its row's assembled answer
    is read with the same framing rules (the relay once folded such a stream only at its end)."""
    upstream.handler = lambda req, reader, writer: _write(writer, _framed(sse_events(req), style))
    proxy = make_proxy(upstream.url, hosted_upstreams=f"teacher={upstream.url}/v1")
    body = {
        "model": "teacher",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    with httpx.stream("POST", proxy.url + CHAT, json=body, headers={"X-Run-Id": "h"}, timeout=10) as r:
        assert r.status_code == 200
        got = b"".join(r.iter_raw())
    req = upstream.completions()[-1]
    assert got == b"".join(_framed(sse_events(req), style))  # as the provider wrote it
    ((status, source, response),) = proxy.query("SELECT status, source, response FROM completions")
    assert (status, source) == ("ok", "hosted")
    assert json.loads(response)["choices"][0]["message"]["content"] == "t4000 t4001 t4002 t4003 "


async def _write(writer: asyncio.StreamWriter, pieces: list[bytes]) -> None:
    writer.write(SSE_HEAD + b"".join(chunk(p) for p in pieces) + b"0\r\n\r\n")


def test_a_chunk_that_is_not_json_makes_the_row_an_error(proxy, upstream):
    """A `data:` event that should hold a chunk but is not JSON: the client still gets the stream
    (that event as the upstream wrote it), and the row is stored as an error, not `ok` with the
    chunk's tokens missing from its answer."""
    upstream.handler = lambda req, reader, writer: _write(
        writer, [*sse_events(req)[:1], b'data: {"choices": [{"delta": \n\n', *sse_events(req)[1:]]
    )
    events, error = stream_events(proxy, 3)
    assert error is None and len(events) == 5 and events[1] == 'data: {"choices": [{"delta": '
    (row,) = rows(proxy)
    assert row["status"] == "error" and "not of the OpenAI shape" in row["error"], row


def test_an_event_that_never_ends_is_cut_at_its_bound(make_proxy, upstream):
    """An upstream that opens an event and never ends it (no blank line): the relay holds at most
    `max_stream_event_bytes` of it (64 KiB here), then cuts the stream as the upstream's fault (502,
    stored with what arrived before), instead of buffering the stream to its end."""
    proxy = make_proxy(upstream.url, upstream_idle_timeout=5.0, max_stream_event_bytes=64 * 1024)

    async def handler(req, reader, writer):
        writer.write(SSE_HEAD + chunk(sse_events(req)[0]) + chunk(b'data: {"choices": [{"delta": "'))
        for _ in range(40):  # 40 x 4 KiB of one event, never ended
            writer.write(chunk(b"x" * 4096))
            await writer.drain()
            await asyncio.sleep(0.01)
        await asyncio.sleep(6)  # then nothing: the cut must not wait for the idle timeout (5 s)
        return "close"

    upstream.handler = handler
    started = time.monotonic()
    events, error = stream_events(proxy, 5)
    assert len(events) == 1 and isinstance(error, httpx.RemoteProtocolError), (events, error)
    assert time.monotonic() - started < 3
    (row,) = rows(proxy)
    assert (row["status"], row["status_code"]) == ("error", 502) and "bytes" in row["error"], row
    assert row["token_ids"] == [[5000]]  # what did arrive is kept


def test_stalled_stream_hits_the_idle_timeout(proxy, upstream):
    """An upstream that stops sending mid-stream: cut after `upstream_idle_timeout` (1 s here),
    stored as `error` (504), the client's stream ended broken."""

    async def handler(req, reader, writer):
        writer.write(SSE_HEAD + chunk(sse_events(req)[0]))
        await writer.drain()
        await asyncio.sleep(30)
        return "close"

    upstream.handler = handler
    started = time.monotonic()
    events, error = stream_events(proxy, 5)
    assert time.monotonic() - started < 8
    assert len(events) == 1 and isinstance(error, httpx.RemoteProtocolError), error
    stored = rows(proxy)[0]
    assert stored["status"] == "error" and stored["status_code"] == 504 and "1 s" in stored["error"]


def _read_until_done_then_hang_up(proxy, run_id: str) -> bytes:
    """A raw client: one streamed chat request, read until `data: [DONE]`, then close the socket."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    ).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1:{proxy.port}\r\ncontent-type: application/json\r\n"
        f"x-run-id: {run_id}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    got = b""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(head + body)
        while b"data: [DONE]" not in got:
            data = s.recv(65536)
            assert data, f"closed before [DONE]: {got!r}"
            got += data
    return got


@pytest.mark.parametrize("client", ["openai-sdk", "raw-socket"])
def test_done_then_a_late_end_of_body_is_ok_when_the_client_hangs_up_on_done(proxy, upstream, client):
    """`[DONE]` in one write, the chunked body's end in a later one (LiteLLM, any server whose
    framework ends the body in a write of its own), and a client that closes the connection on
    `[DONE]` (the openai SDK does; so does the raw client here). The row is `ok` (200) and already
    stored when the client is done, not `cancelled` later (the CI failure of stop 31: a stream's
    row missing right after the client was done)."""
    import openai

    async def handler(req, reader, writer):
        writer.write(SSE_HEAD + b"".join(chunk(e) for e in sse_events(req)))
        await writer.drain()
        await asyncio.sleep(1.5)
        writer.write(b"0\r\n\r\n")
        return None

    upstream.handler = handler
    if client == "openai-sdk":
        sdk = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            extra_headers={"X-Run-Id": "late-end"},
        )
        assert [c.choices[0].delta.content for c in stream] == ["t4000 ", "t4001 ", "t4002 ", "t4003 "]
    else:
        assert b"t4003" in _read_until_done_then_hang_up(proxy, "late-end")
    first = rows(proxy)
    assert [(r["status"], r["status_code"], r["token_ids"]) for r in first] == [
        ("ok", 200, [[4000, 4001, 4002, 4003]])
    ]
    time.sleep(2.0)  # the upstream's end of body has come (or the hang-up was noticed): no change
    assert rows(proxy) == first


def test_stream_cut_by_shutdown_is_stored_as_cut(make_proxy, upstream):
    """Issue case 7: a stream still running when the proxy shuts down is stored as `cancelled`
    with the reason, not as `ok`/200 without a finish_reason."""
    proxy = make_proxy(upstream.url, upstream_timeout=30.0, upstream_idle_timeout=30.0)

    async def handler(req, reader, writer):
        writer.write(SSE_HEAD + chunk(sse_events(req)[0]))
        await writer.drain()
        await asyncio.sleep(30)
        return "close"

    upstream.handler = handler
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", proxy.url + CHAT, json=body, headers={"X-Run-Id": "r"}, timeout=20) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        proxy.server.config.timeout_graceful_shutdown = 0.5
        proxy.stop()
        with pytest.raises(httpx.HTTPError):  # cut, not a clean end
            for _ in lines:
                pass
    con = sqlite3.connect(f"file:{proxy.db_path}?mode=ro", uri=True)
    status, code, error, finish = con.execute(
        "SELECT status, status_code, error, finish_reason FROM completions"
    ).fetchone()
    con.close()
    assert status == "cancelled" and code == 503 and "shut down" in error and finish is None


# ---- pass-through: HEAD/204/304, no replay ---------------------------------------------------


@pytest.mark.parametrize(
    "method, status, extra",
    [
        ("HEAD", 200, b"content-length: 1234\r\n"),
        ("GET", 204, b""),
        ("GET", 304, b'etag: "v1"\r\n'),
        ("DELETE", 204, b"content-length: 0\r\n"),
    ],
)
def test_bodiless_answers_on_the_pass_through_path(proxy, upstream, method, status, extra):
    """HEAD/204/304 carry no body: relayed as such, and the pooled connection stays in step (the
    next request on it gets its own answer)."""

    async def handler(req, reader, writer):
        if req.path.startswith(b"/v1/files/"):
            writer.write(b"HTTP/1.1 %d X\r\n%s\r\n" % (status, extra))
        else:
            writer.write(response(200, b'{"object": "list", "data": []}'))
        return None

    upstream.handler = handler
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        resp = client.request(method, "/v1/files/abc")
        assert resp.status_code == status and resp.content == b""
        if method == "HEAD":
            assert resp.headers["content-length"] == "1234"
        nxt = client.get("/v1/batches")
        assert nxt.status_code == 200 and nxt.json() == {"object": "list", "data": []}
    relayed = [r for r in upstream.requests if r.path in (b"/v1/files/abc", b"/v1/batches")]
    assert [r.path for r in relayed] == [b"/v1/files/abc", b"/v1/batches"]
    assert len({r.conn for r in relayed}) == 1


def test_pass_through_post_is_not_replayed(proxy, upstream):
    """A pass-through POST the upstream read and dropped: 502, sent once."""

    async def handler(req, reader, writer):
        if req.path == b"/v1/batches" and req.method == b"POST":
            return "close"
        writer.write(response(200, b"{}"))
        return None

    upstream.handler = handler
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        assert client.get("/v1/files").status_code == 200  # a kept-alive connection to reuse
        assert_openai_error(client.post("/v1/batches", json={"input_file_id": "f"}), 502)
    time.sleep(0.3)
    assert sum(1 for r in upstream.requests if r.path == b"/v1/batches") == 1


# ---- hop-by-hop headers, both ways ---------------------------------------------------------------

_HOP_REQUEST = (
    b"connection: keep-alive, x-hop-a\r\nx-hop-a: secret\r\nkeep-alive: timeout=5\r\nte: trailers\r\n"
    b"trailer: x-t\r\nproxy-authorization: Basic abc\r\nproxy-connection: keep-alive\r\n"
    b"x-end-to-end: kept\r\nx-utf8: caf\xc3\xa9\r\n"
)
_HOP_RESPONSE = (
    b"connection: x-hop-b\r\nx-hop-b: secret\r\nkeep-alive: timeout=5\r\nproxy-authenticate: Basic\r\n"
    b"trailer: x-t\r\nupgrade: h2c\r\nx-upstream: kept\r\n"
)
_HOP_NAMES = {"connection", "x-hop-a", "x-hop-b", "keep-alive", "te", "trailer", "upgrade", "expect"}


@pytest.mark.parametrize("path", [CHAT, "/v1/files"])
def test_hop_by_hop_headers_never_cross(proxy, upstream, path):
    """Hop-by-hop headers (and the names `Connection` lists, `Proxy-*`, `Expect`, `TE`) reach
    neither the upstream nor the client; end-to-end ones pass both ways."""

    async def handler(req, reader, writer):
        body = completion(req) if req.path == CHAT.encode() else b"{}"
        writer.write(response(200, body, _HOP_RESPONSE))
        return None

    upstream.handler = handler
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    req = (
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%sexpect: 100-continue\r\n"
        b"content-length: %d\r\n\r\n%s" % (path.encode(), _HOP_REQUEST, len(body), body)
    )
    status, headers, _ = raw_request(proxy.port, req, expect_continue=True)
    assert status == 200
    sent = upstream.requests[-1]
    names = {k.decode() for k, _ in sent.headers}
    assert not names & _HOP_NAMES and not any(n.startswith("proxy-") for n in names), names
    assert (
        sent.header(b"x-end-to-end") == b"kept"
        and sent.header(b"host") == f"127.0.0.1:{upstream.port}".encode()
    )
    assert sent.header(b"content-length") == str(len(sent.body)).encode()
    assert sent.header(b"x-utf8") == b"caf\xc3\xa9"  # end-to-end values byte for byte
    got = {k.decode() for k in headers}
    assert not got & (_HOP_NAMES - {"connection"}) and "proxy-authenticate" not in got, got
    assert headers.get(b"connection", b"keep-alive") != b"x-hop-b" and headers[b"x-upstream"] == b"kept"


def test_the_pool_is_capped(make_proxy, upstream):
    """`upstream_max_connections` caps the pool: 6 concurrent requests share 2 connections (the
    rest wait for one), and every one is answered."""
    from concurrent.futures import ThreadPoolExecutor

    proxy = make_proxy(upstream.url, upstream_timeout=10.0, upstream_max_connections=2)

    async def slow(req, reader, writer):
        await asyncio.sleep(0.2)
        return await answer(req, reader, writer)

    upstream.handler = slow
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda n: post(proxy, n, run_id=f"r{n}"), range(1, 7)))
    assert [r.status_code for r in got] == [200] * 6
    assert len({r.conn for r in upstream.completions()}) <= 2
    assert sorted(r["request"]["max_tokens"] for r in rows(proxy)) == [1, 2, 3, 4, 5, 6]
