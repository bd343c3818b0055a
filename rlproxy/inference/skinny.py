"""Decode-step linears split across torch's threads, so a decode step reads the weights at the
bandwidth of every core instead of one.

A decode step multiplies a few rows (one token per running row) by every weight matrix: it is
bound by reading the weights, not by arithmetic. MKL's GEMM for such a skinny product (8 x 576
times 576 x 1536, say) runs on one thread however many torch has: measured on a 2-core VM it takes
the same time at 1 and at 2 threads, and the LM head (49,152 x 576, a quarter of the step) reads at
~5 GB/s. Viewing the weight as `parts` stacked slices of its output features and multiplying them
as one batched product (`bmm`, which torch parallelizes over the batch) lets each thread read its
own slice: 1.3-1.7x on those shapes, ~1.4x on a SmolLM2-135M decode step's matmuls (8 rows).

Only the engine's decode steps take this path (`SplitLinears.parts` > 1 while `Engine._step` runs
the model); prefill, with hundreds of rows, is compute-bound and stays on `F.linear`. A row's
result is the same dot products summed in another kernel: equal to `F.linear` within float
rounding (tests/inference/test_skinny.py), not bit for bit.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # more rows than this and the product is no longer skinny: plain F.linear
MIN_OUT = 256  # narrower outputs (LoRA's A and B) gain nothing from a split


class SplitLinears:
    """Patches every wide `nn.Linear` of `model` (peft's base layers and the LM head included) to
    split its product `parts` ways while `parts` > 1; `parts` is 0 (off) until the engine sets it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.parts = 0
        self.patched = 0
        for module in model.modules():
            if type(module) is torch.nn.Linear and module.out_features >= MIN_OUT:
                module.forward = types.MethodType(_forward_of(self), module)
                self.patched += 1


def _forward_of(split: SplitLinears):
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        parts = split.parts
        n, k = self.weight.shape
        if parts < 2 or n % parts or x.numel() > MAX_ROWS * k:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, k)
        m = rows.shape[0]
        w = self.weight.view(parts, n // parts, k).transpose(1, 2)  # (parts, k, n / parts), no copy
        out = torch.bmm(rows.unsqueeze(0).expand(parts, m, k), w)  # (parts, m, n / parts)
        out = out.transpose(0, 1).reshape(*x.shape[:-1], n)
        return out if self.bias is None else out + self.bias

    return forward
