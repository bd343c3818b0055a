"""A minimal OpenAI-compatible upstream in plain asyncio, for testing and measuring the proxy (not a model).

HTTP/1.1 with keep-alive, no web framework, so its own cost stays far below the proxy's. It answers
like vLLM 0.32: `POST /v1/chat/completions` and `/v1/completions`, streaming or not, with
`prompt_token_ids` / `token_ids` / `logprobs` filled when the request asks for them and explicit
nulls when it does not; `GET /v1/models`, `GET /health`, and vLLM's adapter routes (accepted).

Behaviour knobs: `delay` seconds before answering (the model's pace; a streaming answer spreads it
over its chunks), `tokens` per choice. A request header `x-stub-delay: S` overrides the delay for
that request (the proxy's timeout test uses it). `record=True` keeps every request as (method, path,
headers, body) in `.seen`; `fail_next` holds (status, body) answers a completion request gets first,
in order (a provider's refusal, an engine's 500 with its traceback).

    python tests/stub_upstream.py --port 9100 --delay 0.05

The proxy tests import it (`stub` fixture); bench/proxy.py runs it as this script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import orjson

MODEL = "stub-model"
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}


class StubUpstream:
    """The stub server; `await start()` then use `.url`; `await stop()`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        delay: float = 0.0,
        tokens: int = 8,
        record: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.delay = delay
        self.tokens = tokens
        self.requests = 0
        self.disconnects = 0  # streams the client (the proxy) cut short
        self.record = record
        self.seen: list[tuple[bytes, bytes, dict[bytes, bytes], bytes]] = []
        self.fail_next: list[tuple[int, bytes]] = []
        self.answer_text: str | None = None  # every chat answer's content, when set (else t100 t101 ...)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._conn, self.host, self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):  # keep-alive connections too: the upstream is gone
                w.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path, _ = lines[0].split(b" ", 2)
                headers = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(b":")
                        headers[k.strip().lower()] = v.strip()
                n = int(headers.get(b"content-length", b"0"))
                body = await reader.readexactly(n) if n else b""
                if self.record:
                    self.seen.append((method, path, headers, body))
                if path.endswith(b"completions"):
                    self.requests += 1
                    if self.fail_next:
                        status, failure = self.fail_next.pop(0)
                        self._send(writer, status, failure)
                        await writer.drain()
                        continue
                delay = float(headers[b"x-stub-delay"]) if b"x-stub-delay" in headers else self.delay
                await self._handle(method, path.split(b"?")[0], body, delay, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, RuntimeError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _handle(
        self, method: bytes, path: bytes, body: bytes, delay: float, w: asyncio.StreamWriter
    ) -> None:
        if path in (b"/v1/chat/completions", b"/v1/completions") and method == b"POST":
            req = orjson.loads(body)
            chat = path == b"/v1/chat/completions"
            if req.get("stream"):
                await self._stream(req, chat, delay, w)
            else:
                if delay:
                    await asyncio.sleep(delay)
                self._send(w, 200, orjson.dumps(self._full(req, chat)))
        elif path == b"/v1/models":
            data = {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "root": MODEL, "parent": None}],
            }
            self._send(w, 200, orjson.dumps(data))
        elif path == b"/stub/stats":
            self._send(w, 200, orjson.dumps({"requests": self.requests, "disconnects": self.disconnects}))
        elif path == b"/health":
            self._send(w, 200, b"")
        elif path in (b"/v1/load_lora_adapter", b"/v1/unload_lora_adapter"):
            self._send(w, 200, b"Success")
        else:
            self._send(
                w, 404, b'{"error":{"message":"not found","type":"NotFoundError","param":null,"code":404}}'
            )
        await w.drain()

    @staticmethod
    def _send(w: asyncio.StreamWriter, status: int, body: bytes, ctype: bytes = b"application/json") -> None:
        w.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
            % (status, _REASONS.get(status, b"X"), ctype, len(body))
            + body
        )

    def _ids(self, req: dict, chat: bool) -> tuple[list[int], list[list[int]]]:
        n = req.get("n") or 1
        prompt = [1, 2, 3, 4, 5]
        return prompt, [[100 + i * 10 + t for t in range(self.tokens)] for i in range(n)]

    def _logprobs(self, ids: list[int], chat: bool) -> dict:
        if chat:
            return {
                "content": [
                    {"token": f"t{t}", "logprob": -0.5, "bytes": None, "top_logprobs": []} for t in ids
                ]
            }
        return {
            "text_offset": list(range(len(ids))),
            "token_logprobs": [-0.5] * len(ids),
            "tokens": [f"t{t}" for t in ids],
            "top_logprobs": None,
        }

    def _full(self, req: dict, chat: bool) -> dict:
        prompt, outs = self._ids(req, chat)
        want_ids = bool(req.get("return_token_ids"))
        want_lp = req.get("logprobs") not in (None, False)
        choices = []
        for i, ids in enumerate(outs):
            text = self.answer_text if self.answer_text is not None else " ".join(f"t{t}" for t in ids)
            c: dict = {"index": i}
            if chat:
                c["message"] = {"role": "assistant", "content": text, "tool_calls": []}
            else:
                c["text"] = text
            c["logprobs"] = self._logprobs(ids, chat) if want_lp else None
            c["finish_reason"] = "length"
            c["stop_reason"] = None
            c["token_ids"] = ids if want_ids else None
            if not chat:
                c["prompt_token_ids"] = prompt if want_ids else None
            choices.append(c)
        out = {
            "id": "cmpl-stub",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.get("model", MODEL),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + self.tokens * len(outs),
                "completion_tokens": self.tokens * len(outs),
            },
        }
        if chat:
            out["prompt_token_ids"] = prompt if want_ids else None
        return out

    async def _stream(self, req: dict, chat: bool, delay: float, w: asyncio.StreamWriter) -> None:
        prompt, outs = self._ids(req, chat)
        want_ids = bool(req.get("return_token_ids"))
        want_lp = req.get("logprobs") not in (None, False)
        head = {
            "id": "cmpl-stub",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.get("model", MODEL),
        }
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        def emit(obj: dict | bytes) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"
            w.write(b"%x\r\n%s\r\n" % (len(data), data))

        if chat:
            for i in range(len(outs)):
                emit(
                    {
                        **head,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        "prompt_token_ids": prompt if want_ids else None,
                    }
                )
        pause = delay / self.tokens if delay else 0.0
        for t in range(self.tokens):
            if pause:
                await asyncio.sleep(pause)
            if w.is_closing():  # the client went away: stop generating, like vLLM aborts
                self.disconnects += 1
                return
            for i, ids in enumerate(outs):
                tok = [ids[t]]
                last = t == self.tokens - 1
                c: dict = {"index": i}
                piece = f"t{ids[t]}" + ("" if last else " ")
                if self.answer_text is not None:
                    piece = self.answer_text if t == 0 else ""
                if chat:
                    c["delta"] = {"content": piece}
                else:
                    c["text"] = piece
                c["logprobs"] = self._logprobs(tok, chat) if want_lp else None
                c["finish_reason"] = "length" if last else None
                if last:
                    c["stop_reason"] = None
                c["token_ids"] = tok if want_ids else None
                if not chat and t == 0:
                    c["prompt_token_ids"] = prompt if want_ids else None
                emit({**head, "choices": [c]})
            try:
                await w.drain()
            except ConnectionError:
                self.disconnects += 1
                raise
        emit(b"[DONE]")
        w.write(b"0\r\n\r\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--delay", type=float, default=0.0, help="seconds before answering")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per choice")
    args = ap.parse_args()

    async def serve() -> None:
        stub = StubUpstream(args.host, args.port, args.delay, args.tokens)
        await stub.start()
        print(f"stub upstream at {stub.url} (delay {args.delay} s)", flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())


if __name__ == "__main__":
    main()
