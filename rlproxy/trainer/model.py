"""The policy being trained: the base model plus one LoRA adapter, and its log-probabilities.

Loading goes through unsloth when CUDA and unsloth are both present (the `gpu` extra: faster
kernels, less memory), otherwise plain transformers + peft. The reference model of the KL term is
the same weights with the adapter switched off, so it costs no memory, only a forward pass.
"""

from __future__ import annotations

import importlib.util
import logging
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from rlproxy.errors import ModelError
from rlproxy.trainer.batches import Batch
from rlproxy.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def use_unsloth() -> bool:
    """True when CUDA and the unsloth package are both there."""
    return torch.cuda.is_available() and importlib.util.find_spec("unsloth") is not None


def load_policy(model_path: str, config: TrainerConfig, adapter_dir: str | None = None) -> tuple[Any, Any]:
    """(peft model, tokenizer) for `model_path` with a fresh LoRA adapter, or the one saved in `adapter_dir`.

    The model is in train mode with only the LoRA weights trainable.
    """
    device = pick_device()
    if use_unsloth():
        model, tokenizer = _load_unsloth(model_path, config, adapter_dir)
    else:
        model, tokenizer = _load_peft(model_path, config, adapter_dir, device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.train()
    return model, tokenizer


def _lora_config(model: Any, config: TrainerConfig) -> Any:
    from peft import LoraConfig

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in config.lora_target_modules if t in present]
    if not targets:
        raise ModelError(f"none of lora_target_modules {config.lora_target_modules} exist in the model")
    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _load_peft(
    model_path: str, config: TrainerConfig, adapter_dir: str | None, device: torch.device
) -> tuple[Any, Any]:
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU bf16 matmuls are slow
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the base model from {model_path}: {exc}") from exc
    base.config.use_cache = False  # training never decodes; the KV cache only costs memory
    torch.manual_seed(config.seed)  # LoRA's A matrices are random: same seed, same start
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    else:
        model = get_peft_model(base, _lora_config(base, config))
    return model, tokenizer


def _load_unsloth(
    model_path: str, config: TrainerConfig, adapter_dir: str | None
) -> tuple[Any, Any]:  # pragma: no cover
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=adapter_dir or model_path, max_seq_length=config.max_seq_len, load_in_4bit=False
    )
    if adapter_dir is None:
        lora = _lora_config(model, config)
        model = FastLanguageModel.get_peft_model(
            model,
            r=lora.r,
            lora_alpha=lora.lora_alpha,
            lora_dropout=lora.lora_dropout,
            target_modules=list(lora.target_modules),
            random_state=config.seed,
            use_gradient_checkpointing="unsloth",
        )
    return model, tokenizer


def token_logprobs(model: Any, batch: Batch) -> Tensor:
    """Log-probabilities (B, C) the model gives the batch's sampled tokens.

    When samples share a prompt (a group's runs start from the same task), each distinct prompt
    runs once and its keys/values are fanned out to the samples that share it; the gradient flows
    back through the fan-out, so the result and its gradient are the same as running every sample
    whole, for (B - U) x P fewer token positions.
    """
    if batch.shared_prompts and batch.completion_len > 1:
        return _shared_prompt_logprobs(model, batch)
    device = next(model.parameters()).device
    C = batch.completion_len
    out = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        logits_to_keep=C + 1,  # the prompt's logits are never needed (the LM head is costly)
        use_cache=False,
    )
    logits = out.logits[:, :-1, :]  # (B, C, V): position P-1+t predicts completion token t
    return _gather_logprobs(logits, batch.completion_ids.to(device))


def _shared_prompt_logprobs(model: Any, batch: Batch) -> Tensor:
    device = next(model.parameters()).device
    P, C = batch.prompt_ids.shape[1], batch.completion_len
    index = batch.prompt_index.to(device)
    prompt_mask = batch.prompt_mask.to(device)
    # 1. each distinct prompt once: its keys/values, and the logits of its last token
    first = model(
        input_ids=batch.prompt_ids.to(device),
        attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=1,
        use_cache=True,
    )
    cache = first.past_key_values
    cache.batch_select_indices(index)  # (U, ...) -> (B, ...), differentiable
    # 2. the completions on top: token t (t < C - 1) is the input that predicts token t + 1
    attention = torch.cat([prompt_mask[index], batch.mask[:, : C - 1].to(device, prompt_mask.dtype)], dim=1)
    rest = model(
        input_ids=batch.completion_ids[:, : C - 1].to(device),
        attention_mask=attention,  # (B, P + C - 1)
        position_ids=(attention.cumsum(-1) - 1)[:, P:].clamp(min=0),
        past_key_values=cache,
        use_cache=True,
    )
    logits = torch.cat([first.logits[index, -1:, :], rest.logits], dim=1)  # (B, C, V)
    return _gather_logprobs(logits, batch.completion_ids.to(device))


def _gather_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log_softmax(logits) at `targets` (B, C), without materializing the (B, C, V) log-probabilities."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def reference_logprobs(model: Any, batch: Batch) -> Tensor:
    """The base model's log-probabilities (adapter disabled) of the batch's sampled tokens (B, C)."""
    ctx = model.disable_adapter() if hasattr(model, "disable_adapter") else nullcontext()
    with ctx:
        return token_logprobs(model, batch)


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The LoRA weights (what the optimizer updates)."""
    return [p for p in model.parameters() if p.requires_grad]
