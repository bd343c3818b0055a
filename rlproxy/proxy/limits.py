"""Request limits that every route gets, as pure ASGI in front of everything else.

- Body size: `max_body_bytes` on every route, `max_reward_body_bytes` on reward and complete (the
  route rules say which: `proxy/rules.py`). A
  declared Content-Length over the limit is answered 413 before a byte of the body is read; a body
  without one (chunked) is counted as `receive()` hands it over, and the read that passes the limit
  raises `APIError(413)` into the route (whose handler renders it). Either way the connection is
  closed after the 413 (see `server.LimitedHttpToolsProtocol`), so the rest is never read.
- Requests in flight: above `max_concurrent_requests` a request gets 503 with `Retry-After` at
  once, before any work (a stream counts until its last byte). The rules' uncapped routes
  (`/healthz`, `/metrics`) are exempt, so an overloaded proxy can still be watched.

Header size and count, the header and body deadlines, idle connections and the connection cap act
before a request exists, so they are the HTTP protocol's part (`proxy/server.py`).
"""

from __future__ import annotations

import logging

from rlproxy.errors import APIError
from rlproxy.proxy.errors import error_body, send_json
from rlproxy.proxy.rules import ROUTE_RULES, Rules
from rlproxy.settings import LimitsSettings

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


def too_large(limit: int, declared: int | None = None) -> APIError:
    """The 413 for a body over `limit` bytes (`declared`: its Content-Length, when it had one)."""
    size = f"of {declared} bytes " if declared is not None else ""
    return APIError(413, f"request body {size}exceeds the limit of {limit} bytes", code="body_too_large")


class Limits:
    """ASGI: body size per route and requests in flight (see the module doc)."""

    def __init__(self, app, limits: LimitsSettings, rules: Rules = ROUTE_RULES) -> None:
        self.app = app
        self.is_reward_body = rules.is_reward_body
        self.uncapped = rules.uncapped
        self.max_body = limits.max_body_bytes
        self.max_reward_body = limits.max_reward_body_bytes
        self.max_in_flight = limits.max_concurrent_requests
        self.in_flight = 0
        self.started = 0  # requests begun, ever (`busy`)
        self._seen = 0

    def limit(self, path: str) -> int:
        """The body limit of `path` in bytes."""
        if self.is_reward_body(path):  # a run's reward, and an untagged reply's
            return min(self.max_reward_body, self.max_body)
        return self.max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.uncapped:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            logger.warning("%d requests in flight: refusing %s", self.in_flight, scope["path"])
            body = error_body(
                503,
                f"The server is handling {self.max_in_flight} requests; retry in {RETRY_AFTER_S} s.",
                code="overloaded",
            )
            await send_json(send, 503, body, ((b"retry-after", str(RETRY_AFTER_S).encode()),))
            return
        limit = self.limit(scope["path"])
        for k, v in scope["headers"]:
            if k == b"content-length":
                declared = int(v) if v.isdigit() and len(v) < 19 else limit + 1  # the parser checked it
                if declared > limit:
                    await send_json(send, 413, _body_of(too_large(limit, declared)))
                    return
                # the parser delivers no more than Content-Length bytes: nothing left to count
                await self._call(scope, receive, send)
                return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            chunk = message.get("body")
            if chunk:
                seen += len(chunk)
                if seen > limit:
                    raise too_large(limit)
            return message

        await self._call(scope, counted, send)

    def busy(self) -> bool:
        """Whether a request is in flight or one began since the last call (the loop-lag sampler's
        pace: `Metrics.watch_loop`)."""
        began, self._seen = self.started != self._seen, self.started
        return began or self.in_flight > 0

    async def _call(self, scope, receive, send) -> None:
        self.in_flight += 1
        self.started += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _body_of(exc: APIError) -> bytes:
    """The serialized OpenAI error body of `exc`."""
    return error_body(exc.status, exc.message, exc.type, exc.code, exc.param)
