"""The optional API key, as pure ASGI middleware (no body buffering, streams untouched).

When `settings.api_key` is set, every HTTP request must carry `Authorization: Bearer <key>`,
except the public paths (`/healthz`, and the dashboard's static page which holds no data).
A wrong or missing key gets 401 in OpenAI's error shape, as OpenAI's API answers it.
"""

from __future__ import annotations

import hmac

from rlproxy.proxy.errors import error_body

_HEADERS = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]


class APIKeyMiddleware:
    """Reject requests without the right bearer token (see module doc)."""

    def __init__(self, app, api_key: str, public: tuple[str, ...] = ("/healthz",)) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key.encode()
        self.public = frozenset(public)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        given = b""
        for k, v in scope["headers"]:
            if k == b"authorization":
                given = v
                break
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = (
            "Missing API key: send `Authorization: Bearer <key>`."
            if not given
            else "Incorrect API key provided."
        )
        body = error_body(401, message, code="invalid_api_key")
        await send({"type": "http.response.start", "status": 401, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": body})
