"""Issue 22 cases 10-12: what the upstream says wrongly never reaches a client wrongly.

Case 10: a 502/504 (and the Responses `response.failed` event, tests/proxy/test_responses.py) never
names the upstream's address; a 3xx on the hot routes is refused like on the pass-through. Case 11:
a 200 that is no completion (not JSON, not an object, `choices: ["a"]`, `tool_calls: [5]`) is a 502
in OpenAI's shape with an error row; string token counts are coerced or dropped; a stream whose
chunks cannot be read is stored as an error, never `ok`. Case 12: `Connection: close` on answers
sent before the request body was read (401, 413) and on every 500. The upstream is the raw-socket
one of test_upstream_conformance.py; the wire cases speak raw sockets to the proxy.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import orjson
import pytest
from test_upstream_conformance import (
    CHAT,
    MODEL,
    SSE_HEAD,
    RawUpstream,
    answer,
    assert_openai_error,
    chunk,
    completion,
    response,
)

RESPONSES = "/v1/responses"


@pytest.fixture
def upstream(loop_thread: Any) -> Any:
    up = RawUpstream(handler=answer)
    loop_thread.run(up.start())
    yield up
    loop_thread.run(up.stop())


@pytest.fixture
def proxy(make_proxy: Any, upstream: RawUpstream) -> Any:
    return make_proxy(upstream.url, upstream_timeout=1.0, upstream_idle_timeout=1.0)


def _post(proxy: Any, route: str, run_id: str, stream: bool = False) -> httpx.Response:
    if route == CHAT:
        body: dict = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    else:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 3}
    if stream:
        body["stream"] = True
    return httpx.post(proxy.url + route, json=body, headers={"X-Run-Id": run_id}, timeout=10)


def _row(proxy: Any, run_id: str) -> dict:
    cols = ("status", "status_code", "error", "prompt_tokens", "completion_tokens")
    (r,) = proxy.query(f"SELECT {', '.join(cols)} FROM completions WHERE run_id = ?", run_id)
    return dict(zip(cols, r, strict=True))


def _no_address(text: str, upstream: RawUpstream) -> None:
    assert str(upstream.port) not in text and "127.0.0.1" not in text and "http://" not in text, text


# ---- case 10: the upstream's address never reaches a client --------------------------------------


@pytest.mark.parametrize("route", [CHAT, RESPONSES])
def test_case10_upstream_failures_never_name_the_upstream(proxy, upstream, route):
    """Issue 22 case 10: the 502 of a dropped connection and the 504 of a silent upstream used to
    say `upstream http://127.0.0.1:PORT/v1/chat/completions ...` to the agent."""

    async def drop(req, reader, writer):
        return "close"  # reads the request, answers nothing

    async def silent(req, reader, writer):
        await asyncio.sleep(3)
        return "close"

    for handler, status, run in ((drop, 502, "drop"), (silent, 504, "silent")):
        upstream.handler = handler
        r = _post(proxy, route, run)
        assert_openai_error(r, status)
        _no_address(r.text, upstream)
        assert _row(proxy, run)["status"] == "error"  # the store keeps the detail for the operator


@pytest.mark.parametrize("route", [CHAT, RESPONSES])
def test_case10_redirect_on_a_hot_route_is_refused(proxy, upstream, route):
    """Issue 22 case 10: a 3xx from the upstream on the hot routes was relayed with its Location."""

    async def redirect(req, reader, writer):
        writer.write(response(302, b"{}", b"location: http://10.1.2.3:8000/internal\r\n", b"Found"))
        return None

    upstream.handler = redirect
    r = _post(proxy, route, "moved")
    err = assert_openai_error(r, 502)
    assert err["code"] == "upstream_redirect" and "location" not in r.headers
    assert "10.1.2.3" not in r.text
    _no_address(r.text, upstream)
    row = _row(proxy, "moved")
    assert (row["status"], row["status_code"]) == ("error", 502)


# ---- case 11: garbage 200s are 502s with an error row ---------------------------------------------

_GARBAGE = {
    "not-json": b"this is not json",
    "not-object": b'"a string"',
    "list": b"[1, 2, 3]",
    "choices-str": orjson.dumps({"id": "x", "choices": ["a"]}),
    "tool-calls-int": orjson.dumps(
        {
            "id": "x",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [5]}}],
        }
    ),
    "no-choices": orjson.dumps({"id": "x", "object": "chat.completion"}),
}


@pytest.mark.parametrize("route", [CHAT, RESPONSES])
@pytest.mark.parametrize("kind", list(_GARBAGE))
def test_case11_a_malformed_200_is_a_502_and_an_error_row(proxy, upstream, route, kind):
    """Issue 22 case 11: on /v1/responses a non-JSON or non-object 200 was relayed raw and the
    malformed shapes were 500s that stored nothing; on chat they were relayed as 200s stored `ok`."""

    async def garbage(req, reader, writer):
        writer.write(response(200, _GARBAGE[kind]))
        return None

    upstream.handler = garbage
    r = _post(proxy, route, f"g-{kind}")
    err = assert_openai_error(r, 502)
    assert err["code"] == "upstream_malformed"
    _no_address(r.text, upstream)
    row = _row(proxy, f"g-{kind}")
    assert (row["status"], row["status_code"]) == ("error", 502)
    assert row["error"].startswith("malformed upstream answer")
    upstream.handler = answer  # the next request is served as ever
    assert _post(proxy, route, "after").status_code == 200


@pytest.mark.parametrize("route", [CHAT, RESPONSES])
def test_case11_string_token_counts_are_coerced_or_dropped(proxy, upstream, route):
    """Issue 22 case 11: `usage` with string counts was a 500 on /v1/responses; on chat a string
    count landed in an integer column (and a list one made the record unstorable)."""

    async def odd_usage(req, reader, writer):
        body = orjson.loads(completion(req))
        body["usage"] = {"prompt_tokens": "3", "completion_tokens": [1], "total_tokens": "x"}
        writer.write(response(200, orjson.dumps(body)))
        return None

    upstream.handler = odd_usage
    r = _post(proxy, route, "counts")
    assert r.status_code == 200, r.text
    row = _row(proxy, "counts")
    assert row["status"] == "ok" and row["prompt_tokens"] == 3 and row["completion_tokens"] is None


@pytest.mark.parametrize("route", [CHAT, RESPONSES])
def test_case11_a_stream_the_relay_cannot_read_is_not_stored_ok(proxy, upstream, route):
    """Issue 22 case 11: a stream chunk with `choices: ["a"]` crashed the relay (the assembler or the
    Responses translation) and the row was stored `ok`."""

    async def bad_stream(req, reader, writer):
        good = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
        first = {**good, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]}
        events = [
            b"data: " + orjson.dumps(first) + b"\n\n",
            b"data: " + orjson.dumps({**good, "choices": ["a"]}),
        ]
        events[1] += b"\n\n"
        last = {**good, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        events += [b"data: " + orjson.dumps(last) + b"\n\n", b"data: [DONE]\n\n"]
        writer.write(SSE_HEAD + b"".join(chunk(e) for e in events) + b"0\r\n\r\n")
        return None

    upstream.handler = bad_stream
    try:
        body = _post(proxy, route, "badstream", stream=True).text
    except httpx.HTTPError:  # a cut chat stream
        body = ""
    _no_address(body, upstream)
    row = _row(proxy, "badstream")
    assert row["status"] == "error", row


# ---- case 12: Connection: close whenever the server closes ----------------------------------------


def _raw(port: int, data: bytes) -> tuple[int, dict[bytes, bytes]]:
    """Send `data`, read one response head; its status and headers (lower-case names)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = s.recv(65536)
            assert got, f"closed without an answer: {buf!r}"
            buf += got
    head = buf.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    headers = {}
    for line in head[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower()] = v.strip().lower()
    return int(head[0].split(b" ")[1]), headers


def test_case12_answers_before_the_body_say_connection_close(make_proxy, upstream):
    """Issue 22 case 12: a 401 or 413 sent before the body was read closed the keep-alive connection
    without `Connection: close`, so a pooled client's next request got ECONNRESET."""
    proxy = make_proxy(upstream.url, api_key="sekret")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    # 401: no key; the body (100 bytes declared) is never sent
    status, headers = _raw(proxy.port, head + b"Content-Length: 100\r\n\r\n")
    assert status == 401 and headers.get(b"connection") == b"close"
    # 413: a body over the limit, declared; the key is right
    big = head + b"Authorization: Bearer sekret\r\nContent-Length: 900000000\r\n\r\n"
    status, headers = _raw(proxy.port, big)
    assert status == 413 and headers.get(b"connection") == b"close"
    # a whole request answered normally keeps its connection
    ok = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode()
    status, headers = _raw(
        proxy.port,
        head + b"Authorization: Bearer sekret\r\nContent-Length: %d\r\n\r\n" % len(ok) + ok,
    )
    assert status == 200 and headers.get(b"connection") != b"close"


def test_case12_a_500_from_a_route_says_connection_close(make_proxy, upstream, monkeypatch):
    """Issue 22 case 12: every 500 from a FastAPI route closed the connection silently."""
    from rlproxy.storage import queries

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(queries, "get_run", broken)
    proxy = make_proxy(upstream.url)
    status, headers = _raw(proxy.port, b"GET /v1/runs/r1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 500 and headers.get(b"connection") == b"close"
