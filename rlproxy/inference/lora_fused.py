"""peft's LoRA linear layers in one accumulating product: y = base(x), then y += s (x A^T) B^T in place.

peft's vanilla forward is `result + lora_B(lora_A(dropout(x))) * scaling`: after the two small
products it makes two more (tokens, out) tensors, the scaled one and the sum, and autograd adds a
third pass for the scaling in backward. `fuse_lora` gives each LoRA layer of a model a forward that
lets the second product accumulate into the base layer's output (`addmm_`, alpha = scaling): the same
values and gradients (tests/inference/test_lora_fused.py), two fewer passes over the output forward
and one fewer backward. Used by the trainer's policy and the engine's served adapters.

Only the plain case is fused: one active adapter, not merged, dropout off (p = 0 or eval), no LoRA
variant (DoRA...), no bias on B, one dtype (or autocast: the trainer's bf16 body on CPU), no
per-request `adapter_names` (the engine's mixed batches). Anything else, decided at each call, runs
peft's own forward, so `disable_adapter()` and `set_adapter` behave as in peft.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def fuse_lora(model: torch.nn.Module) -> int:
    """Give every peft LoRA Linear of `model` the fused forward; returns how many. Idempotent."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear and "_unfused_forward" not in module.__dict__:
            module._unfused_forward = module.forward  # the bound peft forward, for every other case
            module.forward = _fused_forward.__get__(module)
            count += 1
    return count


def _plain(m: Any, x: Tensor, autocast: bool) -> str | None:
    """The active adapter's name when this call can be fused, else None."""
    if m.disable_adapters or m.merged or len(m.active_adapters) != 1:
        return None
    name = m.active_adapters[0]
    if name not in m.lora_A or name in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(name):
        return None
    dropout, b = m.lora_dropout[name], m.lora_B[name]
    if not isinstance(dropout, torch.nn.Identity) and not (
        isinstance(dropout, torch.nn.Dropout) and (dropout.p == 0 or not dropout.training)
    ):
        return None
    weight = getattr(m.base_layer, "weight", None)
    if b.bias is not None or not isinstance(weight, Tensor):
        return None
    if not weight.dtype == m.lora_A[name].weight.dtype == b.weight.dtype:
        return None
    # under autocast the matmuls cast their inputs (the product added in place is cast by hand)
    return name if x.dtype == weight.dtype or autocast else None


def _fused_forward(self: Any, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    autocast = torch.is_autocast_enabled(x.device.type)
    name = None if args or kwargs else _plain(self, x, autocast)
    if name is None:
        return self._unfused_forward(x, *args, **kwargs)
    x2 = x.reshape(-1, x.shape[-1])
    if autocast:  # cast once for both products (each would make a copy)
        x2 = x2.to(torch.get_autocast_dtype(x.device.type))
    y = self.base_layer(x2)  # (tokens, out): a fresh tensor, nothing saves it for backward
    xa = torch.nn.functional.linear(x2, self.lora_A[name].weight)  # (tokens, r)
    b = self.lora_B[name].weight
    y.addmm_(xa.to(y.dtype), b.t().to(y.dtype), alpha=self.scaling[name])  # autocast: y, xa are bf16
    return y.view(*x.shape[:-1], y.shape[-1])
