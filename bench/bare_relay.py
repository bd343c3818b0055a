"""The floor under bench/proxy.py: the same server stack as `rlproxy serve` relaying to the same
upstream, and nothing else. uvicorn (uvloop, httptools, as `serve` runs it) and rlproxy's own
upstream client (proxy/http11.py), relaying the body, streamed or not, as it comes; no middleware,
no validation, no capture, no store.

What `rlproxy serve` costs above this is what rlproxy's own work costs (the request checks, the
injected capture fields, the journal and the writer); what this costs above the stub is what any
proxy built on this stack pays before doing anything.

    BARE_RELAY_UPSTREAM=127.0.0.1:9100 python -m uvicorn bench.bare_relay:app --loop uvloop --http httptools
"""

from __future__ import annotations

import os

from rlproxy.proxy import http11

_host, _, _port = os.environ.get("BARE_RELAY_UPSTREAM", "127.0.0.1:9100").rpartition(":")
_pool: http11.Pool | None = None
_HOP = (
    b"host",
    b"content-length",
    b"connection",
    b"transfer-encoding",
    b"keep-alive",
)  # the pool writes its own


async def app(scope, receive, send) -> None:
    global _pool
    if scope["type"] != "http":
        return
    if _pool is None:
        _pool = http11.Pool(_host, int(_port))
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    upstream = await _pool.request(
        scope["method"].encode(),
        scope["raw_path"],
        [(k, v) for k, v in scope["headers"] if k not in _HOP],  # the stub's x-stub-delay too
        b"".join(parts),
    )
    ctype = upstream.header(b"content-type") or b"application/json"
    if ctype.startswith(b"text/event-stream"):
        await send(
            {
                "type": "http.response.start",
                "status": upstream.status_code,
                "headers": [(b"content-type", ctype)],
            }
        )
        while (chunk := await upstream.next_chunk()) is not None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    body = await upstream.read()
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
