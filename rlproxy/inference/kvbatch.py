"""The running batch's KV cache as tensors: build, splice, select and read rows out of it.

Layout: every layer holds keys and values `(B, H, T, D)`; a `(B, T)` mask says which columns are
real tokens (1) and which are padding (0). Rows are left-padded when they join; a row prefilled
after a cached prefix also has padding between its prefix and its new tokens (the mask covers it,
and position ids are counted over the mask, so the row computes exactly what it would alone).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlproxy.inference.prefix_cache import Prefix

HEADROOM = 64  # columns a layer's buffer keeps free beyond a quarter of its length


class GrowingLayer(DynamicLayer):
    """A layer whose keys and values are views `buf[:rows, :, start : start + n]` of a buffer with
    room to grow: a decode step writes its new column in place. DynamicLayer concatenates instead,
    copying the whole cache every step (at 1,500 positions x 8 rows, SmolLM2's 30 layers copied
    ~550 MB per token). A change of the batch works on the buffer too: a leaving row moves the later
    rows up in place (`keep_rows`), a join writes both sides into one new buffer (`splice`). When the
    tensors were replaced from outside (`expand`, another cache's code) or the buffer is full, the
    next update moves them into a new buffer."""

    def owns(self) -> bool:
        """Whether keys and values are still this layer's own views of its buffer."""
        return self.keys is getattr(self, "_kview", None) and self.values is getattr(self, "_vview", None)

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor, rows: int, start: int, n: int) -> None:
        """Make `buf[:rows, :, start : start + n]` this layer's keys and values."""
        self._kbuf, self._vbuf, self._start = kbuf, vbuf, start
        self.keys = self._kview = kbuf[:rows, :, start : start + n]
        self.values = self._vview = vbuf[:rows, :, start : start + n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
        if self.owns() and self._start + n + m <= self._kbuf.shape[-2]:
            start = self._start
        else:
            b, h, _, d = key_states.shape
            room = n + m + max(HEADROOM, (n + m) // 4)
            kbuf, vbuf = key_states.new_empty(b, h, room, d), value_states.new_empty(b, h, room, d)
            if n:
                kbuf[:, :, :n], vbuf[:, :, :n] = self.keys, self.values
            self._kbuf, self._vbuf, start = kbuf, vbuf, 0
        rows = key_states.shape[0]
        self._kbuf[:rows, :, start + n : start + n + m] = key_states
        self._vbuf[:rows, :, start + n : start + n + m] = value_states
        self.adopt(self._kbuf, self._vbuf, rows, start, n + m)
        return self.keys, self.values

    def keep_rows(self, keep: list[int], trim: int) -> None:
        """Keep rows `keep` (ascending) without their first `trim` columns, in place: each kept row
        after a removed one moves up (one row's copy), the trimmed columns are left behind."""
        start, n = self._start + trim, self.keys.shape[-2] - trim
        for i, k in enumerate(keep):
            if i != k:  # i < k: row k is read before anything overwrites it
                self._kbuf[i, :, start : start + n] = self._kbuf[k, :, start : start + n]
                self._vbuf[i, :, start : start + n] = self._vbuf[k, :, start : start + n]
        self.adopt(self._kbuf, self._vbuf, len(keep), start, n)


def new_cache() -> DynamicCache:
    """An empty cache of GrowingLayers (the engine's every cache)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def past_cache(prefixes: list[tuple[Prefix | None, int]]) -> tuple[DynamicCache, torch.Tensor]:
    """A cache holding, for each row, the first `c` positions of its prefix entry, left-padded to the
    longest one; and its `(B, K)` mask. With no prefix at all: an empty cache and a `(B, 0)` mask."""
    width = max(c for _, c in prefixes)
    mask = torch.tensor([[0] * (width - c) + [1] * c for _, c in prefixes], dtype=torch.long)
    cache = new_cache()
    if width == 0:
        return cache, mask.reshape(len(prefixes), 0)
    ref = next(p for p, c in prefixes if p is not None and c > 0)
    for layer in range(len(ref.keys)):
        ks, vs = [], []
        for p, c in prefixes:
            h, _, d = ref.keys[layer].shape
            if p is None or c == 0:
                k = v = ref.keys[layer].new_zeros(h, width, d)
            else:
                k = F.pad(p.keys[layer][:, :c], (0, 0, width - c, 0))  # (H, K, D)
                v = F.pad(p.values[layer][:, :c], (0, 0, width - c, 0))
            ks.append(k)
            vs.append(v)
        cache.update(torch.stack(ks), torch.stack(vs), layer)  # (B, H, K, D)
    return cache, mask


def row_kv(cache: DynamicCache, mask: torch.Tensor, b: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Row `b`'s real columns, per layer `(H, L, D)` (copies, independent of the batch)."""
    cols = mask[b].bool()
    keys = [layer.keys[b][:, cols].contiguous() for layer in cache.layers]
    values = [layer.values[b][:, cols].contiguous() for layer in cache.layers]
    return keys, values


def expand(cache: DynamicCache, mask: torch.Tensor, index: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Rows `index` of the batch (a row may repeat: identical prompts prefilled once, `n` > 1)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
    return cache, mask.index_select(0, index)


def splice(
    old_cache: DynamicCache, old_mask: torch.Tensor, cache: DynamicCache, mask: torch.Tensor
) -> torch.Tensor:
    """Append `cache`'s rows to `old_cache` (in place), left-padding whichever side is shorter;
    returns the joined mask. A GrowingLayer gets one new buffer with room to grow, each side
    copied into it once."""
    old_t, new_t = old_mask.shape[1], mask.shape[1]
    t = max(old_t, new_t)
    for old_layer, new_layer in zip(old_cache.layers, cache.layers, strict=True):
        if isinstance(old_layer, GrowingLayer) and old_layer.is_initialized:
            a, b = old_layer.keys.shape[0], new_layer.keys.shape[0]
            h, d = old_layer.keys.shape[1], old_layer.keys.shape[3]
            room = t + max(HEADROOM, t // 4)
            bufs = []
            for attr in ("keys", "values"):
                old, new = getattr(old_layer, attr), getattr(new_layer, attr)
                buf = old.new_empty(a + b, h, room, d)
                buf[:a, :, : t - old_t].zero_()
                buf[:a, :, t - old_t : t] = old
                buf[a:, :, : t - new_t].zero_()
                buf[a:, :, t - new_t : t] = new
                bufs.append(buf)
            old_layer.adopt(bufs[0], bufs[1], a + b, 0, t)
            continue
        for attr in ("keys", "values"):
            a = F.pad(getattr(old_layer, attr), (0, 0, t - old_t, 0))  # (B, H, T, D)
            b = F.pad(getattr(new_layer, attr), (0, 0, t - new_t, 0))
            setattr(old_layer, attr, torch.cat([a, b], dim=0))
    return torch.cat([F.pad(old_mask, (t - old_t, 0)), F.pad(mask, (t - new_t, 0))], dim=0)


def select(cache: DynamicCache, mask: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Keep rows `keep` (in place) and trim padding columns no remaining row needs; the new mask.
    A GrowingLayer keeps its buffer (`keep_rows`) when `keep` is ascending, as the engine's is."""
    index = torch.tensor(keep)
    mask = mask.index_select(0, index)
    start = int((mask.cumsum(-1) == 0).sum(-1).min())  # leading all-padding columns
    ascending = all(a < b for a, b in zip(keep, keep[1:], strict=False))
    for layer in cache.layers:
        if ascending and isinstance(layer, GrowingLayer) and layer.owns():
            layer.keep_rows(keep, start)
            continue
        layer.keys = layer.keys.index_select(0, index)[:, :, start:]
        layer.values = layer.values.index_select(0, index)[:, :, start:]
    return mask[:, start:]
