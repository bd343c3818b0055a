"""A non-streaming call whose client hangs up, and what notices it, from raw sockets.

`routes_openai._unless_gone` awaits the upstream call in the request's own task; when the client
hangs up, the protocol (`server.Hangup`, from `connection_lost`) cancels the call (its pooled
connection closes, so the upstream stops) and the completion is stored `cancelled` (499). Under
another ASGI server one watcher task per request waits for `http.disconnect` instead
(`server.hangup_calls`). These cases drive the real proxy under uvicorn the way peers do it: a
client that closes its socket mid-call, and keep-alive and pipelined requests, whose callbacks must
end with their requests and never cancel the next one.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

from rlproxy.proxy import server

BODY = json.dumps({"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}).encode()


def _request(run_id: str, delay: float = 0.0) -> bytes:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Run-Id: {run_id}\r\nx-stub-delay: {delay}\r\nContent-Length: {len(BODY)}\r\n\r\n"
    )
    return head.encode() + BODY


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _responses(sock: socket.socket, n: int) -> list[int]:
    """Read `n` responses (Content-Length bodies) off `sock`; their status codes."""
    buf, codes = b"", []
    while len(codes) < n:
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            assert data, f"connection closed after {len(codes)} of {n} responses"
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        codes.append(int(lines[0].split()[1]))
        length = next(
            int(v) for k, _, v in (x.partition(b":") for x in lines[1:]) if k.lower() == b"content-length"
        )
        while len(buf) < length:
            buf += sock.recv(65536)
        buf = buf[length:]
    return codes


def _rows(proxy: Any, n: int, timeout: float = 10.0) -> list[tuple]:
    deadline = time.monotonic() + timeout
    rows: list[tuple] = []
    while time.monotonic() < deadline:
        rows = proxy.query("SELECT run_id, status, status_code, latency_ms FROM completions ORDER BY id")
        if len(rows) >= n:
            break
        time.sleep(0.05)
    return rows


def test_a_client_that_closes_mid_call_cancels_it(make_proxy, stub):
    proxy = make_proxy(stub.url)
    sock = _connect(proxy.url)
    sock.sendall(_request("gone", delay=5.0))
    time.sleep(0.3)
    sock.close()  # the whole request was sent; the answer is 5 s away
    ((run_id, status, code, latency_ms),) = _rows(proxy, 1)
    assert (run_id, status, code) == ("gone", "cancelled", 499)
    assert latency_ms < 3000  # cancelled when the client left, not when the upstream answered


def test_keep_alive_requests_each_end_their_watcher(make_proxy, stub):
    proxy = make_proxy(stub.url)
    with _connect(proxy.url) as sock:
        for i in range(5):  # one connection, one request after another
            sock.sendall(_request(f"ka-{i}"))
            assert _responses(sock, 1) == [200]
    assert [r[1:3] for r in _rows(proxy, 5)] == [("ok", 200)] * 5


def test_pipelined_requests_are_answered_in_order_and_none_cancelled(make_proxy, stub):
    proxy = make_proxy(stub.url)
    with _connect(proxy.url) as sock:
        # the second request arrives while the first is at the upstream: it is no disconnect
        sock.sendall(_request("p-0", delay=0.3) + _request("p-1") + _request("p-2"))
        assert _responses(sock, 3) == [200, 200, 200]
    rows = _rows(proxy, 3)
    assert sorted(r[:3] for r in rows) == [("p-0", "ok", 200), ("p-1", "ok", 200), ("p-2", "ok", 200)]


def test_a_call_in_flight_has_no_watcher_task(make_proxy, stub, loop_thread):
    """Under `rlproxy serve`'s protocol the hang-up comes from `connection_lost`: the request's own
    task is the only one (the watcher task per request was ~0.1 ms of CPU each, issue 24)."""
    proxy = make_proxy(stub.url)
    sock = _connect(proxy.url)
    sock.sendall(_request("watched", delay=1.0))
    time.sleep(0.4)

    async def tasks() -> list[str]:
        return [t.get_coro().__qualname__ for t in asyncio.all_tasks()]

    names = loop_thread.run(tasks())
    sock.close()
    assert any(n.endswith("run_asgi") for n in names), names  # the request is in flight
    assert not [n for n in names if n.endswith((".watch", "._watch"))], names
    assert _rows(proxy, 1)[0][1:3] == ("cancelled", 499)


def test_hangup_calls_without_the_protocol_watches_receive():
    """Under another server (no `Hangup` in the scope) one task waits for `http.disconnect`."""

    async def main() -> list[str]:
        messages: asyncio.Queue = asyncio.Queue()
        called: list[str] = []
        with server.hangup_calls({"type": "http"}, messages.get, lambda: called.append("gone")):
            await messages.put({"type": "http.disconnect"})
            await asyncio.sleep(0.05)
        with server.hangup_calls({"type": "http"}, messages.get, lambda: called.append("late")):
            await asyncio.sleep(0.01)  # left before any disconnect: its watcher is cancelled
        await messages.put({"type": "http.disconnect"})
        await asyncio.sleep(0.05)
        return called

    assert asyncio.run(main()) == ["gone"]


def test_a_connection_lost_before_the_call_registers_still_cancels_it():
    """`Hangup.add` after the connection was lost calls back (soon) rather than never."""

    async def main() -> list[str]:
        hangup = server.Hangup()
        called: list[str] = []
        hangup.fire()
        with server.hangup_calls({"extensions": {server.HANGUP: hangup}}, None, lambda: called.append("x")):
            await asyncio.sleep(0.01)
        hangup.fire()  # fired again (a refusal then the loss): nothing registered, nothing called
        return called

    assert asyncio.run(main()) == ["x"]
