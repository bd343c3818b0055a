"""The async side of one HTTP request: submit prompts to the engine, await their rows' deltas.

This is the single place where the event loop meets the worker thread: the engine calls the sink
from its thread, and the sink hops onto the loop with `call_soon_threadsafe`. Leaving the `async
with` block early (client disconnect, error) cancels whatever is still decoding.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rlproxy.inference.engine import Engine, GenRequest, RowDelta
from rlproxy.inference.sampling import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


@dataclass
class Choice:
    """One choice assembled from its deltas (for non-streaming responses and usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, d: RowDelta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


class Generation:
    """Prompts × n rows submitted as one unit; choice index = prompt_index * n + row index."""

    def __init__(
        self,
        engine: Engine,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        adapter: str | None,
        priority: int = 0,
        salt: str | None = None,
    ) -> None:
        self.engine, self.prompts, self.params, self.n = engine, prompts, params, n
        self.adapter, self.priority = adapter, priority
        self.salt = salt  # the prefix cache's isolation key (`cache_salt`)
        self.ids = [f"gen-{uuid.uuid4().hex}" for _ in prompts]
        self.choices = [Choice() for _ in range(len(prompts) * n)]
        self._queue: asyncio.Queue[tuple[int, RowDelta]] = asyncio.Queue()
        self._open = len(self.choices)

    async def __aenter__(self) -> Generation:
        loop = asyncio.get_running_loop()
        for p, (rid, prompt) in enumerate(zip(self.ids, self.prompts, strict=True)):
            base = p * self.n

            def sink(d: RowDelta, base: int = base) -> None:
                try:
                    loop.call_soon_threadsafe(self._queue.put_nowait, (base + d.index, d))
                except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                    pass

            self.engine.submit(
                GenRequest(
                    rid,
                    prompt,
                    self.params,
                    sink,
                    n=self.n,
                    adapter=self.adapter,
                    priority=self.priority,
                    salt=self.salt,
                )
            )
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._open:
            for rid in self.ids:
                self.engine.cancel(rid)

    async def deltas(self) -> AsyncIterator[tuple[int, RowDelta]]:
        """(choice index, delta) in arrival order until every choice has finished."""
        while self._open:
            index, d = await self._queue.get()
            self.choices[index].add(d)
            if d.finish_reason is not None:
                self._open -= 1
            yield index, d

    async def finish(self) -> list[Choice]:
        """Wait for every choice and return them assembled."""
        async for _ in self.deltas():
            pass
        return self.choices

    def prompt_ids(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def token_text(tokenizer: Any, token_id: int) -> str:
    """How a single token is shown in logprobs (its own decoded text, as vLLM shows it)."""
    return tokenizer.decode([token_id])


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for t in lps:
        s = token_text(tokenizer, t.token_id)
        top = []
        for tid, v in t.top:
            ts = token_text(tokenizer, tid)
            top.append({"token": ts, "logprob": _lp(v), "bytes": list(ts.encode())})
        content.append(
            {"token": s, "logprob": _lp(t.logprob), "bytes": list(s.encode()), "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """OpenAI completions `logprobs`: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for t in lps:
        s = token_text(tokenizer, t.token_id)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(_lp(t.logprob))
        out["tokens"].append(s)
        out["top_logprobs"].append({token_text(tokenizer, tid): _lp(v) for tid, v in t.top} or None)
        offset += len(s)
    return out
