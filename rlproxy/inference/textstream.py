"""Incremental detokenization of one row, with stop strings.

Text is re-decoded from all generated ids each step (cheap for completion lengths, and exact where
byte-level tokens only form valid UTF-8 together). Two things are held back from the stream until
they are settled: a trailing incomplete character (`\ufffd`) and the last `len(longest stop) - 1`
characters, which could still turn into a stop string; a stop string itself is never sent, as in
vLLM.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    """Turns a row's token ids into text deltas and reports the stop string that ended it."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` already handed out

    def push(self, token_id: int, final: bool = False) -> tuple[str, str | None]:
        """Add a token; returns (text delta, the stop string hit or None). `final` flushes everything."""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hit, cut = None, len(self.text)
        for s in self.stop:
            at = self.text.find(s)
            if at != -1 and at < cut:
                hit, cut = s, at
        if hit is not None:
            delta = self.text[self.sent : max(cut, self.sent)]
            self.sent = max(cut, self.sent)
            self.text = self.text[:cut]
            return delta, hit
        if final:
            return self.flush(), None
        limit = len(self.text) - self.hold
        while limit > self.sent and self.text[limit - 1] == "\ufffd":
            limit -= 1  # an incomplete multi-byte character: wait for its other bytes
        if limit <= self.sent:
            return "", None
        delta = self.text[self.sent : limit]
        self.sent = limit
        return delta, None

    def flush(self) -> str:
        """Everything not yet handed out (at the end of the row)."""
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta
