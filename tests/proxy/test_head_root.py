"""`HEAD /` is answered 200 (issue 56): Claude Code's first request checks the server is there
with it, and got 405. Raw socket: what the client sends, what it gets back, no body."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def test_head_of_the_root_is_200_without_a_body(make_proxy, stub):
    proxy = make_proxy(stub.url)
    where = urlsplit(proxy.url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as conn:
        conn.sendall(
            f"HEAD / HTTP/1.1\r\nHost: {where.hostname}:{where.port}\r\nConnection: close\r\n\r\n".encode()
        )
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"content-type: text/html" in head.lower() and body == b""
