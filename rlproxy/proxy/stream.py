"""Relaying a server-sent-event stream to the client while capturing it.

Bytes go to the client as they arrive: when nothing was injected the upstream's bytes are sent
untouched; when capture fields were injected each complete `data:` event is re-serialized without
them (a partial event waits for its end, never longer). Every event is also folded into a
`StreamAssembler` for the store. Events are read as SSE frames them: a byte order mark first is
ignored, a line ends with LF, CRLF or CR (sse-starlette, under many OpenAI-compatible servers,
writes CRLF), `data:` with or without its space, a value over several `data:` lines is one value;
a `data:` that opens a JSON object but is not JSON is relayed as it came and makes the row an error
(its tokens are missing from the answer); an event not ended within `max_event` bytes
(`max_stream_event_bytes`) cuts the stream as the upstream's fault, so a peer that never ends one
cannot grow the buffer to the whole stream.

The relay is told when the client's connection is lost (`server.hangup_calls`): a client that goes
away cancels the relay task, which closes the upstream response (so the upstream aborts the generation) and
stores the partial completion with status `cancelled` (499). However else a stream ends early it is
stored as cut, never as `ok`: an upstream that drops the connection or sends nothing for
`upstream_idle_timeout` is `error` (502/504) and the client's response is ended without its last
chunk (the connection is closed, so the client can tell it from a clean end); a relay cancelled by
the proxy's shutdown is `cancelled` (503) with the reason.

With `translate` (a translated API's `EventStream`: the Responses API, Anthropic's Messages) the
client gets other events than the upstream sends: every chat chunk is still folded into the
assembler, and what goes out is the events it makes, opened by its `start` (response.created/
in_progress) and closed by its `end` (response.completed: in the last write, after the store
report) or, when the upstream breaks, its `fail` (response.failed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import Response

from rlproxy.errors import BackendError, BackendUnavailable
from rlproxy.proxy import http11, server
from rlproxy.proxy.capture import Injected, StreamAssembler
from rlproxy.proxy.errors import public_message

logger = logging.getLogger(__name__)

# (status, error, ttft seconds, HTTP status to store) -> None; stores the record
Done = Callable[[str, "str | None", "float | None", int], None]


def _one_value(lines: list[bytes], data_at: list[int]) -> list[bytes]:
    """An event whose value spans several `data:` lines (SSE joins them with a LF) with that value
    on its first line, when it is JSON: its LFs are then whitespace (JSON strings hold none), so
    spaces stand for them. A value that is not JSON stays as it came (and is not folded)."""
    value = b"\n".join(lines[i][6:] if lines[i][5:6] == b" " else lines[i][5:] for i in data_at)
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        return lines
    rest = set(data_at[1:])
    one = [line for j, line in enumerate(lines) if j not in rest]
    one[data_at[0]] = b"data: " + value.replace(b"\n", b" ")
    return one


def _lf(data: bytes, cr: bool) -> tuple[bytes, bool]:
    """`data` with SSE's CRLF and lone CR line ends made LF, and whether it ended with a CR. `cr`:
    the read before ended with one, so a LF first here is the rest of that CRLF, not a blank line."""
    if cr and data[:1] == b"\n":
        data = data[1:]
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n"), data[-1:] == b"\r"


def _sse(events: list[dict]) -> bytes:
    """Typed events as SSE: `event: <type>` + `data: <json>` each (an event without a type: `data:`)."""
    out = b""
    for event in events:
        data = b"data: " + orjson.dumps(event) + b"\n\n"
        out += b"event: " + event["type"].encode() + b"\n" + data if "type" in event else data
    return out


class EventStream:
    """A translated API's events (its wire/ translator: `start`, `feed`, `finish`, `fail`, `response`)
    as the bytes the relay sends: an upstream error event mid-stream fails it, nothing follows an end."""

    __slots__ = ("events", "ended")

    def __init__(self, events: Any) -> None:
        self.events = events
        self.ended = False  # a terminal event (completed, incomplete, failed, message_stop) was sent

    def start(self) -> bytes:
        return _sse(self.events.start())

    def chunk(self, chunk: dict) -> bytes:
        if self.ended:
            return b""
        if "error" in chunk and not chunk.get("choices"):  # the upstream's error event mid-stream
            err = chunk["error"]
            return self.fail(err.get("message") if isinstance(err, dict) else str(err))
        return _sse(self.events.feed(chunk))

    def end(self) -> bytes:
        """The events that end a stream the upstream ended well."""
        if self.ended:
            return b""
        self.ended = True
        return _sse(self.events.finish())

    def fail(self, message: str) -> bytes:
        """The events that end a stream the upstream broke."""
        if self.ended:
            return b""
        self.ended = True
        return _sse(self.events.fail(message))

    @property
    def response(self) -> dict:
        return self.events.response


class StreamRelay(Response):
    """An ASGI response that relays `upstream` (headers read) and reports how it ended."""

    def __init__(
        self,
        upstream: http11.Response,
        headers: list[tuple[bytes, bytes]],
        assembler: StreamAssembler,
        inj: Injected,
        started: float,
        done: Done,
        translate: EventStream | None = None,
        *,
        max_event: int,
    ) -> None:
        self.upstream, self.raw_headers, self.assembler, self.inj = upstream, headers, assembler, inj
        self.started, self.done, self.translate = started, done, translate
        self.max_event = max_event  # bytes of one event not yet ended: past it, the upstream's fault
        self.status_code = upstream.status_code
        self.background = None
        self.ttft: float | None = None
        self.error: str | None = None
        self.saw_done = False  # the `[DONE]` event: the completion is whole, whatever follows it
        self._reported = False

    def _report(self, status: str, code: int) -> None:
        """Store the record once: before the last byte when the stream ends well, else when it ends."""
        if self._reported:
            return
        self._reported = True
        if status == "ok" and self.error is None and self.assembler.malformed:
            self.error = "the upstream's stream had chunks not of the OpenAI shape (skipped)"
        if status == "ok" and self.error is not None:
            status = "error"
        self.done(status, self.error, self.ttft, code)

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        state = {"finished": False, "disconnected": False}

        def hang_up() -> None:
            if not state["finished"]:
                state["disconnected"] = True
                task.cancel()

        with server.hangup_calls(scope, receive, hang_up):
            status, code = "ok", self.upstream.status_code
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.upstream.status_code,
                        "headers": self.raw_headers,
                    }
                )
                if self.translate is not None:
                    opening = self.translate.start()
                    await send({"type": "http.response.body", "body": opening, "more_body": True})
                await self._relay(send)
            except asyncio.CancelledError:
                if not state["disconnected"]:  # not the client: the proxy is shutting down
                    status, code = "cancelled", 503
                    self.error = "stream cut: the proxy shut down before the upstream finished"
                    raise
                task.uncancel()
                status, code = "cancelled", 499
            except BackendError as exc:  # the upstream dropped or stalled mid-stream
                # returning without the final body makes the server close the connection: the
                # client sees a cut stream (no terminating chunk), never a clean end
                status, code = "error", exc.status
                self.error = f"upstream stream broke: {exc}"
                logger.warning("%s", self.error)
                await self._fail(send, status, code, public_message(exc))
            except Exception as exc:  # a chunk the relay could not handle: stored as an error, never ok
                status, code = "error", 502
                self.error = f"the stream could not be relayed: {type(exc).__name__}: {exc}"[:2000]
                logger.warning("%s", self.error, exc_info=exc)
                await self._fail(
                    send, status, code, "The model server sent a stream that is not a valid completion."
                )
            except OSError:  # the server noticed the client's disconnect on write first
                status, code = "cancelled", 499
            finally:
                state["finished"] = True
                self.upstream.close()  # a cut stream closes the upstream connection: the upstream aborts
                self._report(status, code)

    async def _fail(self, send, status: str, code: int, message: str) -> None:
        """End a broken stream: the Responses API says response.failed (with `message`, which never
        names the upstream); a chat stream is cut (no final chunk: the client can tell)."""
        if self.translate is None:
            return
        body = self.translate.fail(message)
        self._report(status, code)
        try:
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except OSError:
            pass

    async def _relay(self, send) -> None:
        """Relay until the upstream's body ends; the last write also ends the response (one syscall)."""
        buf = b""
        cr = False  # the last read ended with a CR: a LF first in the next one ends the same line
        head = True  # the stream's first bytes are still to be read for a byte order mark
        rewrite = self.inj.any or self.translate is not None
        upstream = self.upstream
        while True:
            data = await upstream.next_chunk()  # BackendError if the upstream drops or stalls
            if data is None:
                break
            # SSE's other line ends (CRLF, CR) read as LF; sent as they came. `13 in` (CR) is one
            # memchr: `b"\r" in` took ~350 ns on a 250-byte chunk, a tenth of an event's relay
            if cr or 13 in data:
                text, cr = _lf(data, cr)
                buf += text
            else:
                buf += data
            if head and len(buf) >= 3:  # SSE ignores a UTF-8 byte order mark before the first event
                head = False
                if buf.startswith(b"\xef\xbb\xbf"):
                    buf = buf[3:]
            out: list[bytes] = []
            while True:
                end = buf.find(b"\n\n")
                if end < 0:
                    break
                event, buf = buf[:end], buf[end + 2 :]
                out.append(self._event(event, rewrite))
            if len(buf) > self.max_event:
                raise BackendUnavailable(f"the upstream sent an event of over {self.max_event} bytes")
            last = upstream.finished and not buf.strip()
            body = b"".join(out) if rewrite else data
            if last and self.translate is not None:
                body += self.translate.end()
            if last or self.saw_done:  # journaled before the client can have the whole stream
                # (storage/journal.py); at `[DONE]` too: the openai SDK closes the connection on
                # it, without waiting for an end of body that comes in a later write
                self._report("ok", upstream.status_code)
            if body or last:
                await send({"type": "http.response.body", "body": body, "more_body": not last})
            if last:
                return
        tail = self._event(buf, rewrite) if buf.strip() else b""  # a last event without its blank line
        if self.translate is not None:
            tail += self.translate.end()
        self._report("ok", upstream.status_code)
        await send({"type": "http.response.body", "body": tail if rewrite else b"", "more_body": False})

    def _event(self, event: bytes, rewrite: bool) -> bytes:
        """Fold one SSE event into the assembler; the bytes to send for it (when rewriting)."""
        # vLLM's every event: one data line (`10 not in`, LF, is one memchr: ~60 ns, not ~440)
        if event.startswith(b"data: {") and 10 not in event:
            return self._data(event, 0, None, rewrite)
        lines = event.split(b"\n")
        data_at = [i for i, line in enumerate(lines) if line.startswith(b"data:")]
        if len(data_at) > 1:
            lines = _one_value(lines, data_at)
        translated = b""
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            out = self._data(line, i, lines, rewrite)
            if self.translate is not None:
                translated += out
            elif rewrite and out == b"":
                return b""
        if self.translate is not None:
            return translated
        return b"\n".join(lines) + b"\n\n" if rewrite else b""

    def _data(self, line: bytes, i: int, lines: list[bytes] | None, rewrite: bool) -> bytes:
        """One `data:` line: folded in, and (rewriting) `lines[i]` replaced; `lines` None: the event
        is this one line (vLLM's every event). What the one-line fast path sends; the general path
        reads only the translation's and an empty chunk's b""."""
        payload = line[5:].strip()
        if payload == b"[DONE]" or not payload:
            self.saw_done = self.saw_done or bool(payload)
            return self._as_is(line, lines, rewrite)
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            chunk = None
            # a chunk that is not JSON: relayed as it came, but the answer stored lacks its tokens
            self.assembler.malformed = self.assembler.malformed or payload[:1] == b"{"
        if type(chunk) is not dict:
            return self._as_is(line, lines, rewrite)
        if "error" in chunk and not chunk.get("choices"):
            self.error = str(chunk["error"])
        assembler = self.assembler
        # folded in, and (rewriting for the client) stripped; a chunk left empty is not sent
        empty = assembler.feed(chunk, rewrite and self.translate is None)
        if self.ttft is None and assembler.got_token:
            self.ttft = time.perf_counter() - self.started
        if self.translate is not None:
            return self.translate.chunk(chunk)
        if not rewrite or empty:
            return b""
        data = b"data: " + orjson.dumps(chunk)
        if lines is None:
            return data + b"\n\n"
        lines[i] = data
        return b"\n".join(lines) + b"\n\n"

    def _as_is(self, line: bytes, lines: list[bytes] | None, rewrite: bool) -> bytes:
        """An event sent as the upstream wrote it (when rewriting, and not translating)."""
        if not rewrite or self.translate is not None:
            return b""
        return (line if lines is None else b"\n".join(lines)) + b"\n\n"
