"""Trainer settings: plain values, each with its range or reason. Saved with every step and checkpoint."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class TrainerConfig(BaseModel):
    """Everything a GRPO step needs to know. `Settings` inherits these fields (env RLPROXY_<NAME>)."""

    # which runs make a step
    group_size: int = Field(4, ge=2, description="completed runs that make a group ready")
    groups_per_step: int = Field(1, ge=1, description="ready groups taken by one optimizer step")
    group_timeout: float = Field(
        600.0, gt=0, description="seconds after a group's newest run when it is ready with >= 2 runs"
    )
    # advantages and loss
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = Field("grpo", description="policy-gradient loss")
    scale_rewards: Literal["group", "none"] = Field(
        "group", description="divide advantages by the group's reward std (group) or not (none)"
    )
    epsilon: float | None = Field(
        None,
        ge=0,
        description="lower clip range of the importance ratio; None = the loss's default "
        "(0.2; gspo 3e-4, its sequence ratio moves far less than a token's)",
    )
    epsilon_high: float | None = Field(
        None,
        ge=0,
        description="upper clip range; None = epsilon when it is set, else the loss's default "
        "(0.2; dapo 0.28 clip-higher; gspo 4e-4)",
    )
    ratio_cap: float | None = Field(
        3.0,
        gt=1,
        description="dual-clip bound C: a negative-advantage token's loss stops growing at ratio C "
        "(stale or mismatched samples cannot take C x the gradient); None = off",
    )
    max_policy_lag: int | None = Field(
        8,
        ge=0,
        description="samples drawn more than this many adapter steps ago are not trained on (counted "
        "batch/stale; a step left with none marks its runs skipped); None = no limit",
    )
    sampling_logprobs: Literal["raw", "processed"] = Field(
        "raw",
        description="what the backend's stored logprobs are: raw = log_softmax(logits), vLLM's default "
        "and the embedded engine's; processed = after temperature (vLLM --logprobs-mode processed_logprobs)",
    )
    overlong_filter: bool = Field(
        False, description="leave out samples cut by max_tokens or max_seq_len (DAPO's overlong filtering)"
    )
    beta: float = Field(
        0.0, ge=0, description="KL penalty weight against the base model; 0 = no KL, no ref pass"
    )
    max_seq_len: int = Field(
        2048, ge=16, description="tokens per sample; longer samples are truncated and counted"
    )
    # LoRA and optimizer
    lora_r: int = Field(8, ge=1, description="LoRA rank")
    lora_alpha: int = Field(16, ge=1, description="LoRA alpha (scale = alpha / r)")
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="LoRA dropout (the base model's dropout is always off while training)"
    )
    lora_target_modules: list[str] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="module names that get LoRA weights",
    )
    learning_rate: float = Field(1e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient-norm clip")
    micro_batch_size: int = Field(8, ge=1, description="samples per forward/backward; bounds memory")
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: less memory, slower (prompts not shared)"
    )
    seed: int = Field(0, description="torch seed of the trainer")
    # checkpoints and publishing
    checkpoint_dir: str = Field("checkpoints", description="folder holding {policy}/step-NNNN/ checkpoints")
    keep_checkpoints: int = Field(
        3, ge=1, description="newest checkpoints kept on disk (and adapters served)"
    )
    unload_grace: float = Field(
        30.0, ge=0, description="seconds an old adapter stays loaded after a newer one"
    )
    poll_interval: float = Field(1.0, gt=0, description="seconds between looks for ready groups")
    train_threads: int | None = Field(
        None, ge=1, description="torch threads for training; None = torch's default"
    )
