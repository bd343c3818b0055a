"""Issue 9, case 4 ("no limits off the hot path") and the limits of "Bounded everything".

Each test pins one case: bodies and headers that must not be buffered, deadlines for heads, bodies
and idle connections, the connection and in-flight caps, JSON depth, `rlproxy sql`'s statement
timeout and the access log. The proxy runs under the uvicorn.Config `rlproxy serve` uses
(`proxy/server.py`); tests about the HTTP layer speak raw sockets.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from proxy_helpers import ProxyServer
from typer.testing import CliRunner

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BIN = Path(__file__).resolve().parents[2] / ".venv" / "bin"
MB = 1024 * 1024


@pytest.fixture
def serve(make_proxy: Any, stub: Any) -> Any:
    """serve(**settings) -> a proxy in front of the stub upstream, on a fresh database."""
    return lambda **overrides: make_proxy(stub.url, **overrides)


def _connect(proxy: ProxyServer, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after its answer counts as the end)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _status_and_error(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"], head.lower()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """The highest RSS of this process (the proxy runs in it) while the block runs, sampled at 100 Hz."""

    def __enter__(self) -> _PeakRSS:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / MB


def _stream(sock: socket.socket, head: bytes, piece: bytes, total: int) -> int:
    """Send `head` then `piece` repeatedly up to `total` bytes; the bytes sent when the server cut us off."""
    sent = 0
    try:
        sock.sendall(head)
        while sent < total:
            sock.sendall(piece)
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    return sent


# --- body size on every route -----------------------------------------------------------------


def test_400mb_declared_body_to_a_passthrough_route_is_413_unread(serve):
    """Case 4: a 400 MB body to a forwarded route was read whole (+375 MB); now 413 from Content-Length."""
    proxy = serve()
    sock = _connect(proxy)
    with _PeakRSS() as rss:
        sock.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 400000000\r\n\r\n" + b"x" * MB
        )
        status, error, head = _status_and_error(_read_all(sock))
    sock.close()
    assert status == 413 and error["code"] == "body_too_large"
    assert set(error) == {"message", "type", "param", "code"}
    assert rss.growth_mb < 20, f"RSS grew {rss.growth_mb:.0f} MB"


def test_400mb_chunked_body_to_a_passthrough_route_is_cut_at_the_limit(serve):
    """Case 4: the same body without Content-Length (chunked) is refused once the count passes the limit."""
    proxy = serve()
    sock = _connect(proxy, timeout=20)
    chunk = b"%x\r\n" % MB + b"x" * MB + b"\r\n"
    head = (
        b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    with _PeakRSS() as rss:
        sent = _stream(sock, head, chunk, 400 * MB)
        answer = _read_all(sock)
    sock.close()
    assert sent < 64 * MB, f"the server read {sent / MB:.0f} MB of a body over its 8 MB limit"
    if answer:  # the kernel may reset the connection before the client reads the 413
        assert _status_and_error(answer)[0] == 413
    assert rss.growth_mb < 20, f"RSS grew {rss.growth_mb:.0f} MB"


def test_reward_route_has_a_small_body_limit(serve):
    """Bounded everything: the reward route takes `max_reward_body_bytes` (64 KiB), not 8 MB."""
    proxy = serve()
    body = {"reward": 1.0, "metadata": {"x": "y" * (100 * 1024)}}
    r = httpx.post(f"{proxy.url}/v1/runs/r1/reward", json=body)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


# --- headers --------------------------------------------------------------------------------------


def test_200mb_header_is_431_without_buffering(serve):
    """Case 4: a 200 MB header was accepted (1.5 GB peak); now 431 and close at 64 KiB."""
    proxy = serve()
    sock = _connect(proxy, timeout=20)
    with _PeakRSS() as rss:
        sent = _stream(sock, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ", b"a" * MB, 200 * MB)
        answer = _read_all(sock)
    sock.close()
    assert sent < 32 * MB, f"the server read {sent / MB:.0f} MB of headers"
    if answer:
        status, error, _ = _status_and_error(answer)
        assert status == 431 and error["code"] == "headers_too_large"
    assert rss.growth_mb < 20, f"RSS grew {rss.growth_mb:.0f} MB"


def test_too_many_headers_is_431(serve):
    """Bounded everything: more than `max_headers` headers is 431 in OpenAI's shape, then close."""
    proxy = serve(max_headers=20)
    sock = _connect(proxy)
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(30))
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n")
    status, error, head = _status_and_error(_read_all(sock))
    assert status == 431 and "20" in error["message"] and b"connection: close" in head


# --- deadlines ------------------------------------------------------------------------------------


def test_slowloris_head_is_closed_after_the_header_deadline(serve):
    """Case 4 (slowloris): a head trickled byte by byte is answered 408 and closed after `header_timeout`."""
    proxy = serve(header_timeout=1.0)
    sock = _connect(proxy)
    start = time.monotonic()
    closed_after = None
    try:
        for byte in b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 100:
            sock.sendall(bytes([byte]))
            time.sleep(0.05)
    except (BrokenPipeError, ConnectionResetError):
        closed_after = time.monotonic() - start
    answer = _read_all(sock)
    closed_after = closed_after or time.monotonic() - start
    assert closed_after < 3.0, f"still open after {closed_after:.1f} s"
    if answer:
        assert _status_and_error(answer)[0] == 408


def test_half_sent_head_is_closed(serve):
    """Case 4 (half-sent request): a head that stops mid-way is closed after `header_timeout`."""
    proxy = serve(header_timeout=1.0)
    sock = _connect(proxy)
    start = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    status, error, _ = _status_and_error(_read_all(sock))
    assert status == 408 and error["code"] == "request_timeout"
    assert 0.9 < time.monotonic() - start < 3.0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/files"])
def test_trickled_body_is_closed_after_the_body_deadline(serve, path):
    """Case 4 (trickle): a body sent 10 bytes at a time is answered 408 and closed after `body_timeout`."""
    proxy = serve(body_timeout=1.0)
    sock = _connect(proxy)
    body = json.dumps(CHAT).encode()
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (path.encode(), len(body))
    )
    start = time.monotonic()
    answer = b""
    try:
        for i in range(0, len(body) - 1, 2):  # never the last byte
            sock.sendall(body[i : i + 2])
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = _read_all(sock)
    assert time.monotonic() - start < 4.0
    status, error, _ = _status_and_error(answer)
    assert status == 408 and "body" in error["message"]


def test_idle_connection_is_closed(serve):
    """Case 4 (idle): a connection that never sends a byte is closed after `keep_alive_timeout`."""
    proxy = serve(keep_alive_timeout=1.0)
    sock = _connect(proxy, timeout=5)
    start = time.monotonic()
    assert _read_all(sock) == b""
    assert 0.9 < time.monotonic() - start < 3.0


def test_keep_alive_still_works(serve):
    """The deadlines do not cut ordinary keep-alive traffic: many requests on one connection."""
    proxy = serve(header_timeout=1.0, body_timeout=1.0)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)
    for _ in range(5):
        assert client.chat.completions.create(**CHAT).choices[0].message.content is not None
        time.sleep(0.3)  # 1.5 s in all: longer than both deadlines


# --- caps -----------------------------------------------------------------------------------------


def test_requests_over_the_in_flight_cap_get_503_with_retry_after(serve):
    """Bounded everything: over `max_concurrent_requests` a request is 503 + Retry-After, OpenAI shape."""
    proxy = serve(max_concurrent_requests=2)
    slow = {**CHAT, "stream": True}
    results: list[int] = []

    def hold() -> None:
        r = httpx.post(
            f"{proxy.url}/v1/chat/completions", json=slow, headers={"x-stub-delay": "2"}, timeout=10
        )
        results.append(r.status_code)

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while proxy.app.in_flight < 2 and time.monotonic() < deadline:  # limits.Limits
        time.sleep(0.02)
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded"
    assert httpx.get(f"{proxy.url}/healthz").status_code in (200, 503)  # exempt: still answered
    for t in threads:
        t.join()
    assert results == [200, 200]
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT).status_code == 200


def test_connections_over_the_cap_get_503_with_retry_after(serve):
    """Bounded everything: a request on a connection past `max_connections`: 503 + Retry-After, close."""
    proxy = serve(max_connections=2)
    held = [_connect(proxy) for _ in range(2)]
    time.sleep(0.1)
    sock = _connect(proxy)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    status, error, head = _status_and_error(_read_all(sock))
    assert status == 503 and b"retry-after: 1" in head and error["code"] == "overloaded"
    for s in held:
        s.close()
    time.sleep(0.1)
    assert httpx.get(f"{proxy.url}/v1/models").status_code == 200


# --- JSON depth and what a 500 may say ------------------------------------------------------------


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _no_leak(text: str) -> None:
    for word in ("Traceback", "SELECT", "INSERT", "UPDATE ", "sqlalchemy", "JSONEncodeError"):
        assert word not in text, f"{word!r} leaked in {text[:300]!r}"


def test_300_deep_json_is_400_on_chat_and_reward(serve):
    """Case 4: 300-deep JSON passed validation, then 500 with a traceback (chat) or SQL text (reward)."""
    proxy = serve()
    deep_chat = {**CHAT, "messages": [{"role": "user", "content": "hi", "x": _nested(300)}]}
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=deep_chat, headers={"X-Run-Id": "deep"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep", r.text
    _no_leak(r.text)
    r = httpx.post(f"{proxy.url}/v1/runs/deep/reward", json={"reward": 1.0, "metadata": {"x": _nested(300)}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep", r.text
    _no_leak(r.text)
    # NaN literals take the other parser on the reward route: it is bounded too
    raw = '{"reward": NaN, "metadata": {"x": ' + "[" * 300 + "]" * 300 + "}}"
    r = httpx.post(
        f"{proxy.url}/v1/runs/deep/reward", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    _no_leak(r.text)
    # and just under the limit still works
    ok = {**CHAT, "messages": [{"role": "user", "content": "hi", "x": _nested(50)}]}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=ok).status_code == 200


def test_a_500_says_nothing_of_the_failure(serve, monkeypatch, caplog):
    """Case 4: the reward route leaked SQL text in an error; a 500 is now generic, the log has the rest."""
    from sqlalchemy.exc import OperationalError

    from rlproxy.storage import queries

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("SELECT secret FROM runs WHERE id = ?", ("r",), Exception("disk I/O error"))

    monkeypatch.setattr(queries, "get_run", broken)
    proxy = serve()
    with caplog.at_level("ERROR", logger="rlproxy.proxy.errors"):
        r = httpx.get(f"{proxy.url}/v1/runs/r1")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    _no_leak(r.text)
    assert "secret" not in r.text
    ref = r.json()["error"]["message"].split("error id ")[1].rstrip(").")
    assert any(ref in rec.getMessage() and rec.exc_info for rec in caplog.records)


# --- rlproxy sql, access log ----------------------------------------------------------------------


def test_sql_has_a_statement_timeout(tmp_path):
    """Case 7: `rlproxy sql` had no statement timeout; a query that runs forever is interrupted."""
    from rlproxy.cli.main import app

    db = tmp_path / "t.db"
    sqlite3.connect(db).close()
    forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    start = time.monotonic()
    out = CliRunner().invoke(app, ["sql", forever, "--db", str(db), "--timeout", "0.5"])
    assert out.exit_code == 1 and "interrupted" in out.output and "--timeout" in out.output
    assert time.monotonic() - start < 10


def test_access_log_works_with_the_embedded_engine(tiny_model_dir, tmp_path):
    """Case 7: `--access-log` printed nothing with the embedded engine (its uvicorn.Config reset the log)."""
    env = {**os.environ, "RLPROXY_ENGINE_THREADS": "1", "RLPROXY_CACHE_DIR": str(tiny_model_dir.parents[1])}
    proc = subprocess.Popen(
        [str(BIN / "rlproxy"), "serve", "--model", str(tiny_model_dir), "--no-train", "--port", "0"]
        + ["--db", str(tmp_path / "a.db"), "--access-log"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        base = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and base is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "OPENAI_BASE_URL=" in line:
                base = line.split("OPENAI_BASE_URL=", 1)[1].strip()
        assert base, "".join(lines)
        assert httpx.get(f"{base}/models").status_code == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    text = "".join(lines) + out
    assert '"GET /v1/models HTTP/1.1" 200' in text, text[-3000:]
