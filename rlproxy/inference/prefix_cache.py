"""The embedded engine's prefix KV cache: token ids → their keys and values, LRU, bounded in bytes.

An agent's next call is its last prompt + the completion it got + a few new messages, so most of
a prompt was already through the model. The engine keeps the KV of what it prefilled and decoded
(per row: the prompt, and at the end the prompt + the sampled ids), and a new prompt reuses the
longest stored common prefix; only the rest is prefilled. Any common prefix is usable, not only a
whole entry: the KV of positions 0..c-1 depends on tokens 0..c-1 alone (causal attention), so
siblings of a group that diverge after their shared first prompt still share that prompt.

Entries are keyed by adapter *slot* as well: the KV computed under adapter A never serves adapter B
or the base model, and a slot retired by an in-place reload or an unload takes its entries with it
(`retain`). And by *salt* (a request's `cache_salt`, vLLM's field; the proxy sends an app key's id):
a prompt under one salt never reuses KV stored under another, so one app's prompts are never hits
for another, neither in time to first token nor in `cached_tokens` (issue 55). At least the
prompt's last token is always prefilled (its logits pick the first token).

Owned by the engine's worker thread (no locks); `stats` is read by the metrics collector from other
threads (plain ints, replaced whole).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class Prefix:
    """The stored KV of `tokens` under `slot`: per layer `(H, L, D)` keys and values."""

    slot: str
    tokens: torch.Tensor  # (L,) int64
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int
    salt: str | None = None


class PrefixCache:
    """Longest-common-prefix lookup over stored KV; evicts least recently used past `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes  # 0 = off: lookups miss, nothing is stored
        self._entries: OrderedDict[int, Prefix] = OrderedDict()
        self._next = 0
        self.bytes = 0
        self.stats = {
            "lookups": 0,  # prompts looked up (one per distinct prompt admitted)
            "hits": 0,  # lookups that reused at least one token
            "tokens_looked_up": 0,  # prompt tokens of those lookups
            "tokens_reused": 0,  # prompt tokens not prefilled thanks to the cache
            "evictions": 0,
            "stores": 0,
        }

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, slot: str, prompt: list[int], salt: str | None = None) -> tuple[Prefix | None, int]:
        """The entry sharing the longest prefix with `prompt` under `slot` and `salt` and that length
        (at most len(prompt) - 1); (None, 0) on a miss. A hit becomes the most recently used entry."""
        if not self.enabled:
            return None, 0
        self.stats["lookups"] += 1
        self.stats["tokens_looked_up"] += len(prompt)
        limit = len(prompt) - 1
        if limit <= 0 or not self._entries:
            return None, 0
        want = torch.tensor(prompt[:limit], dtype=torch.long)
        best_key, best = None, 0
        for key, entry in self._entries.items():
            if entry.slot != slot or entry.salt != salt:
                continue
            n = min(limit, entry.tokens.numel())
            same = entry.tokens[:n] == want[:n]
            c = n if bool(same.all()) else int(same.to(torch.int8).argmin())
            if c > best or (c == best and c > 0):  # ties: the most recent one (iteration order)
                best_key, best = key, c
        if best_key is None or best == 0:
            return None, 0
        self._entries.move_to_end(best_key)
        self.stats["hits"] += 1
        self.stats["tokens_reused"] += best
        return self._entries[best_key], best

    def put(
        self,
        slot: str,
        tokens: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        salt: str | None = None,
    ) -> None:
        """Store the KV of `tokens` (per layer `(H, L, D)`, owned by the cache from now on).

        An entry that is a prefix of the new one is dropped (the new one serves all it served); a new
        one that is a prefix of a stored one only refreshes that one."""
        if not self.enabled or not tokens:
            return
        nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
        if nbytes > self.max_bytes:
            return
        new = torch.tensor(tokens, dtype=torch.long)
        for key, entry in list(self._entries.items()):
            if entry.slot != slot or entry.salt != salt:
                continue
            n = entry.tokens.numel()
            if n <= new.numel() and torch.equal(entry.tokens, new[:n]):
                self._remove(key)
            elif n > new.numel() and torch.equal(entry.tokens[: new.numel()], new):
                self._entries.move_to_end(key)
                return
        self._next += 1
        self._entries[self._next] = Prefix(slot, new, keys, values, nbytes, salt)
        self.bytes += nbytes
        self.stats["stores"] += 1
        while self.bytes > self.max_bytes and self._entries:
            self._remove(next(iter(self._entries)))
            self.stats["evictions"] += 1

    def retain(self, live_slots: set[str]) -> None:
        """Drop every entry whose slot is not in `live_slots` (its adapter was reloaded or unloaded)."""
        for key in [k for k, e in self._entries.items() if e.slot not in live_slots]:
            self._remove(key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._remove(key)

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
