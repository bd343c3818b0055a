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
    """A layer whose keys and values are views of a buffer with room to grow: a decode step writes
    its new column in place. DynamicLayer concatenates instead, copying the whole cache every step
    (at 1,500 positions x 8 rows, SmolLM2's 30 layers copied ~550 MB per token). When the tensors
    were replaced from outside (this module's splice, select, expand) or the buffer is full, the
    next update moves them into a new buffer: one copy per change of the batch, not per token."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
        ours = self.keys is getattr(self, "_kview", None) and self.values is getattr(self, "_vview", None)
        if not ours or n + m > self._kbuf.shape[-2]:
            b, h, _, d = key_states.shape
            room = n + m + max(HEADROOM, (n + m) // 4)
            kbuf, vbuf = key_states.new_empty(b, h, room, d), value_states.new_empty(b, h, room, d)
            if n:
                kbuf[:, :, :n], vbuf[:, :, :n] = self.keys, self.values
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[:, :, n : n + m] = key_states
        self._vbuf[:, :, n : n + m] = value_states
        self.keys = self._kview = self._kbuf[:, :, : n + m]
        self.values = self._vview = self._vbuf[:, :, : n + m]
        return self.keys, self.values


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
    returns the joined mask."""
    old_t, new_t = old_mask.shape[1], mask.shape[1]
    t = max(old_t, new_t)
    for old_layer, new_layer in zip(old_cache.layers, cache.layers, strict=True):
        for attr in ("keys", "values"):
            a = F.pad(getattr(old_layer, attr), (0, 0, t - old_t, 0))  # (B, H, T, D)
            b = F.pad(getattr(new_layer, attr), (0, 0, t - new_t, 0))
            setattr(old_layer, attr, torch.cat([a, b], dim=0))
    return torch.cat([F.pad(old_mask, (t - old_t, 0)), F.pad(mask, (t - new_t, 0))], dim=0)


def select(cache: DynamicCache, mask: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Keep rows `keep` (in place) and trim padding columns no remaining row needs; the new mask."""
    index = torch.tensor(keep)
    mask = mask.index_select(0, index)
    start = int((mask.cumsum(-1) == 0).sum(-1).min())  # leading all-padding columns
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)[:, :, start:]
        layer.values = layer.values.index_select(0, index)[:, :, start:]
    return mask[:, start:]
