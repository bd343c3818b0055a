"""One copy of the frozen base weights in embedded mode (issue 21 item 7): a twin of the engine's model.

The trainer and the engine in one process each need the base model with their own LoRA modules
(peft injects its layers into the module tree it is given, and one PeftModel cannot serve two
threads). `twin_model` builds a second module tree on the meta device and points every parameter
and buffer at the engine's own tensors: two trees, one set of weights. Neither side ever writes a
base weight (the engine runs under inference mode, peft freezes the base for the trainer), so the
sharing is safe; each side's LoRA weights are its own.

The engine's tree may already hold peft's LoRA layers (`x.base_layer.weight` for `x.weight`); the
twin gets the plain names and no LoRA. The twin's config is a copy: the trainer turns the KV
cache off in its config, which must not reach the engine's.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from rlproxy.errors import ModelError


def twin_model(base: torch.nn.Module) -> torch.nn.Module:
    """A new model of `base`'s architecture whose parameters and buffers are `base`'s tensors."""
    source: dict[str, torch.Tensor] = {}
    for name, tensor in (
        *base.named_parameters(remove_duplicate=False),
        *base.named_buffers(remove_duplicate=False),
    ):
        if ".lora_" not in name:
            source[name.replace(".base_layer.", ".")] = tensor
    dtype = next(base.parameters()).dtype
    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), dtype=dtype)
    modules = dict(twin.named_modules())
    made: dict[int, torch.nn.Parameter] = {}  # tied weights (embeddings = LM head) stay one Parameter
    for name, _ in [*twin.named_parameters(remove_duplicate=False)]:
        owner, _, leaf = name.rpartition(".")
        if name not in source:
            raise ModelError(f"cannot share the base weights: the engine's model has no {name}")
        tensor = source[name]
        if id(tensor) not in made:
            made[id(tensor)] = torch.nn.Parameter(tensor.detach(), requires_grad=False)
        modules[owner]._parameters[leaf] = made[id(tensor)]
    for name, _ in [*twin.named_buffers(remove_duplicate=False)]:
        owner, _, leaf = name.rpartition(".")
        if name not in source:
            raise ModelError(f"cannot share the base weights: the engine's model has no buffer {name}")
        modules[owner]._buffers[leaf] = source[name]
    twin.generation_config = copy.deepcopy(base.generation_config)
    return twin
