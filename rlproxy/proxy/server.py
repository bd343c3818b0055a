"""The HTTP server: uvicorn on httptools, plus the connection limits uvicorn does not have.

uvicorn's httptools protocol holds a request head of any size (httptools joins a header's pieces as
they arrive: a 200 MB header took 1.5 GB) and waits without end for a head or a body that trickles
in. `LimitedHttpToolsProtocol` keeps httptools' speed and adds, per connection:

- head size: request line + headers over `max_header_bytes` (counted as bytes arrive, so at most
  one socket read past the limit is ever held), or more than `max_headers` headers: 431, close;
- head deadline: `header_timeout` seconds from a request's first byte to its last header: 408, close;
- body deadline: `body_timeout` seconds from the headers to the body's last byte: 408 and close (only
  close if the answer has begun);
- idle: a new connection that sends nothing is closed after `keep_alive_timeout`, as uvicorn already
  does between requests;
- connection cap: a request on a connection beyond `max_connections`: 503 + Retry-After, close;
- a response sent before its request's body was read whole (413, 401, 400, ...) closes the
  connection instead of reading the rest of the body, and says so (`Connection: close`), as every
  500 does (uvicorn closes the connection after an application error);
- a lost connection is told to the request it interrupts: the route registers a callback on the
  scope's `extensions["rlproxy.hangup"]` (a `Hangup`) and the protocol calls it from
  `connection_lost`, so a route needs no task of its own watching `receive()` for `http.disconnect`;
- the access log goes to the `rlproxy.access` logger, which no other uvicorn server in the process
  can switch off (the embedded engine's uvicorn.Config resets the global `uvicorn.access` one); the
  values of query parameters that carry secrets (`SECRET_PARAMS`: `?key=`, `?api_key=`, `?token=`,
  ...) are written as `[redacted]` (a browser or a script may put a key in the URL).

Every refusal is in OpenAI's error shape. `config(app, settings, ...)` is the uvicorn.Config that
`rlproxy serve` runs.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any
from urllib.parse import unquote_plus

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from rlproxy.proxy.errors import error_body
from rlproxy.proxy.limits import RETRY_AFTER_S
from rlproxy.settings import LimitsSettings, Settings

logger = logging.getLogger(__name__)
ACCESS_LOGGER = logging.getLogger("rlproxy.access")
SECRET_PARAMS = frozenset({"key", "api_key", "api-key", "apikey", "token", "access_token", "admin_key"})


def redact_query(path: str) -> str:
    """`path` (with its query string) with the values of `SECRET_PARAMS` replaced (names compared
    decoded and lower-cased, so `?KEY=` and `?%6Bey=` are found too)."""
    base, _, query = path.partition("?")
    parts = []
    for part in query.split("&"):
        name, eq, _value = part.partition("=")
        if eq and unquote_plus(name).strip().lower() in SECRET_PARAMS:
            part = f"{name}=[redacted]"
        parts.append(part)
    return f"{base}?{'&'.join(parts)}"


class _RedactQuery(logging.Filter):
    """On the access logger: uvicorn's line is `'%s - "%s %s HTTP/%s" %d'`, the path third."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (args[0], args[1], redact_query(args[2]), args[3], args[4])
        return True


ACCESS_LOGGER.addFilter(_RedactQuery())


HANGUP = "rlproxy.hangup"  # the scope's extensions key of the connection's `Hangup`


class Hangup:
    """The callbacks to run when a connection is lost (or refused) mid-request: one per request
    waiting on its upstream, added and discarded by the route (`routes_openai._unless_gone`)."""

    __slots__ = ("callbacks", "lost")

    def __init__(self) -> None:
        self.callbacks: set = set()
        self.lost = False

    def add(self, callback: Any) -> None:
        """Run `callback()` when the connection is lost; at once (soon) if it already is."""
        if self.lost:
            asyncio.get_running_loop().call_soon(callback)
        else:
            self.callbacks.add(callback)

    def discard(self, callback: Any) -> None:
        self.callbacks.discard(callback)

    def fire(self) -> None:
        self.lost = True
        callbacks, self.callbacks = self.callbacks, set()
        for callback in callbacks:
            callback()


class hangup_calls:
    """`with hangup_calls(scope, receive, callback):` runs `callback()` if the client's connection
    is lost inside the block. Under this module's protocol the connection's `Hangup` calls it;
    under another ASGI server one watcher task waits for `receive()` to say `http.disconnect`
    (so only where the request's body is read whole: then that is all `receive()` can return)."""

    __slots__ = ("hangup", "receive", "callback", "watcher")

    def __init__(self, scope: dict, receive: Any, callback: Any) -> None:
        self.hangup = scope.get("extensions", {}).get(HANGUP)
        self.receive = receive
        self.callback = callback
        self.watcher: asyncio.Task | None = None

    def __enter__(self) -> None:
        if self.hangup is not None:
            self.hangup.add(self.callback)
        else:
            self.watcher = asyncio.ensure_future(self._watch())

    def __exit__(self, *exc: object) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        else:
            self.hangup.discard(self.callback)

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.callback()


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that was just refused."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head/body limits and deadlines (see the module doc)."""

    limits: LimitsSettings = LimitsSettings()  # the settings' group: bounds per connection (bytes, s)
    log_access = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access_logger = ACCESS_LOGGER
        self.access_log = self.log_access
        self._in_head = True  # between requests or reading a head: bytes count against the head size
        self._head_bytes = 0
        self._n_headers = 0
        self._over_capacity = False
        self._refused = False
        # one deadline at a time (head, then body); the timer is re-armed lazily, not per request
        self._deadline: float | None = None
        self._late: Any = None  # what to do when the deadline passes
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._hangup = Hangup()  # one per connection, in every request's scope (see the module doc)

    # --- connection ---
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._over_capacity = len(self.connections) > self.limits.max_connections
        # uvicorn arms the idle timer only after a response; a connection that never sends is idle too
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)
        self._hangup.fire()

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if not self._refused:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes", False)

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and cycle.more_body:
            # answered before its body was read (413, 401): close rather than read the rest
            self.transport.close()
        super().on_response_complete()

    # --- parser callbacks ---
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._n_headers = 0
        self._arm(self.limits.header_timeout, self._head_late)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._n_headers += 1
        if self._n_headers > self.limits.max_headers:
            self._refuse(431, f"more than {self.limits.max_headers} request headers", False)
            raise _Refused()
        # uvicorn's own on_header, inlined: it runs for every header of every request
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._cancel_timer()
        if self._over_capacity:
            logger.warning("more than %d connections: refusing a request", self.limits.max_connections)
            self._refuse(
                503,
                f"The server holds {self.limits.max_connections} connections; retry in {RETRY_AFTER_S} s.",
                False,
                code="overloaded",
                headers=b"retry-after: %d\r\n" % RETRY_AFTER_S,
            )
            raise _Refused()
        self.scope.setdefault("extensions", {})[HANGUP] = self._hangup  # the cycle's scope
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None:
            cycle.send = _closing_send(cycle, cycle.send)
        if not self.pipeline:  # a queued (pipelined) request is not read until its turn: no deadline
            self._arm(self.limits.body_timeout, self._body_late)

    def on_message_complete(self) -> None:
        self._cancel_timer()
        self._in_head = True
        self._head_bytes = 0
        super().on_message_complete()

    # --- deadlines and refusals ---
    def _arm(self, seconds: float, late: Any) -> None:
        """Set the deadline `seconds` from now; `late()` runs if it passes first.

        Per request this is a clock read: a timer already pending (one every few seconds per busy
        connection) is left alone and re-armed for the deadline of the moment when it fires.
        """
        self._deadline = at = self.loop.time() + seconds
        self._late = late
        if self._timer is None or self._timer_at > at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(at, self._on_timer)
            self._timer_at = at

    def _cancel_timer(self) -> None:
        self._deadline = None  # a pending timer finds nothing to do

    def _on_timer(self) -> None:
        self._timer = None
        if self._deadline is None or self.transport.is_closing():
            return
        if self.loop.time() < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._on_timer)
            self._timer_at = self._deadline
            return
        self._deadline = None
        self._late()

    def _head_late(self) -> None:
        self._refuse(408, f"request headers not received within {self.limits.header_timeout:g} s", False)

    def _body_late(self) -> None:
        self._refuse(408, f"request body not received within {self.limits.body_timeout:g} s", True)

    def _refuse(
        self, status: int, message: str, current: bool, code: str | None = None, headers: bytes = b""
    ) -> None:
        """Answer `status` if no other answer is under way on this connection, then close it.

        `current`: the refused request is `self.cycle` (body phase) rather than a new head.
        """
        self._refused = True
        self._cancel_timer()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        idle = cycle is None or cycle.response_complete
        if idle or (current and not cycle.response_started):
            code = code or {408: "request_timeout", 431: "headers_too_large"}.get(status)
            self._write_error(status, message, code, headers)
            logger.warning("%s %d: %s", _peer(self.client), status, message)
        else:
            logger.warning("%s closed: %s", _peer(self.client), message)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() now says http.disconnect; its sends are dropped
            cycle.message_event.set()
            self._hangup.fire()
        self.transport.close()

    def _write_error(self, status: int, message: str, code: str | None, headers: bytes) -> None:
        body = error_body(status, message, code=code)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n",
                headers,
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))


def _closing_send(cycle: Any, send: Any) -> Any:
    """`send` that says `Connection: close` on a response the connection will not outlive: one
    sent before its request's body was read whole (400, 401, 413: the rest is not read, the
    connection is closed, see on_response_complete), and every 500 (uvicorn closes the connection
    after an application error). A pooled client then opens a new connection for its next request
    instead of writing into one that is closing (ECONNRESET).

    Stored as `cycle.send`, it holds the cycle weakly and calls its class's `send`: a closure over
    the cycle (or over its bound `send`) made every request's cycle a reference cycle, left to the
    garbage collector (issue 24)."""
    ref = weakref.ref(cycle)
    unbound = type(cycle).send
    if getattr(send, "__func__", None) is not unbound:  # not uvicorn's own: wrapped as it is
        unbound = None

    async def closing_send(message: Any) -> None:
        c = ref()
        if c is None:  # the request is over: nothing holds its cycle any more
            return
        if message["type"] == "http.response.start" and (c.more_body or message["status"] == 500):
            c.keep_alive = False  # uvicorn then writes `connection: close` and closes after it
        await (unbound(c, message) if unbound is not None else wrapped(message))

    wrapped = None if unbound is not None else send
    return closing_send


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "client"


def protocol_class(limits: LimitsSettings, access_log: bool) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to `limits`."""
    bound = {"limits": limits, "log_access": access_log}
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), bound)


def config(
    app: Any, settings: Settings, *, access_log: bool = True, log_level: str = "info", **overrides: Any
) -> uvicorn.Config:
    """The uvicorn.Config that serves `app` with every limit of `settings` (overrides: Config's own)."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "http": protocol_class(settings.group(LimitsSettings), access_log),
        "access_log": access_log,
        "proxy_headers": False,  # X-Forwarded-* rewriting: unused here, and it runs on every request
        "log_level": log_level,
        "timeout_keep_alive": settings.keep_alive_timeout,
        "backlog": settings.backlog,
        "limit_concurrency": None,  # ours: limits.Limits (OpenAI shape, Retry-After) and the connection cap
        "timeout_graceful_shutdown": 10,
        **overrides,
    }
    return uvicorn.Config(app, **options)
