"""Trainer settings: plain values, each with its range or reason. Saved with every step and checkpoint.

Imports nothing of the trainer's: every other trainer module may import it (the tracker names that
`report_to` accepts live here for that reason; reporting.py sends to them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

# learning_rate=None: measured 1e-3 for SmolLM2-135M (hidden 576) with LoRA r=8/alpha=16 (LEARNING_FACTS),
# scaled down with the hidden size like Thinking Machines' fit of the best LoRA learning rate
# (~ hidden ** -0.78 for Llama models, "LoRA Without Regret", 2025).
LR_ANCHOR_HIDDEN = 576
LR_ANCHOR = 1e-3
LR_EXPONENT = 0.75
LR_FALLBACK = 1e-4  # a model whose config names no hidden size


TRACKERS: dict[str, str] = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
}  # name -> module


def parse_report_to(value: str | None) -> list[str]:
    """The tracker names of a comma list ("tensorboard,wandb"); ValueError for an unknown one."""
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker(s) {unknown}; report_to takes {', '.join(TRACKERS)}")
    return list(dict.fromkeys(names))


def learning_rate_for(hidden_size: int | None) -> float:
    """The default learning rate of a model of this hidden size (None: LR_FALLBACK), 3 significant digits.

    Never above LR_ANCHOR: smaller models than the one measured (the test model `tiny`) are not
    extrapolated to larger rates.
    """
    if not hidden_size or hidden_size <= 0:
        return LR_FALLBACK
    return float(f"{LR_ANCHOR * min(1.0, LR_ANCHOR_HIDDEN / hidden_size) ** LR_EXPONENT:.3g}")


class TrainerConfig(BaseModel):
    """Everything a GRPO step needs to know. `Settings` inherits these fields (env RLPROXY_<NAME>)."""

    # which runs make a step
    group_size: int = Field(4, ge=2, description="completed runs that make a group ready")
    groups_per_step: int = Field(1, ge=1, description="ready groups taken by one optimizer step")
    group_timeout: float = Field(
        600.0, gt=0, description="seconds after a group's newest run when it is ready with >= 2 runs"
    )
    # live traffic: runs still alone in their group group_timeout after their reward (status `ungrouped`)
    singletons: Literal["ungrouped", "train"] = Field(
        "ungrouped",
        description="runs alone in their group past group_timeout become status `ungrouped`; train = "
        "then train them in batches, each run's advantage against its batch's mean reward (REINFORCE++)",
    )
    singleton_batch: int = Field(
        16,
        ge=2,
        description="ungrouped runs of one policy per step with singletons=train (>= 2 are taken once the "
        "newest has waited another group_timeout)",
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
    learning_rate: float | None = Field(
        None,
        gt=0,
        description="AdamW learning rate; None = by model size, 1e-3 x (576 / hidden_size) ** 0.75: 1e-3 for "
        "SmolLM2-135M, 3.9e-4 for Qwen2.5-3B (see README, Training)",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient-norm clip")
    micro_batch_size: int = Field(8, ge=1, description="rows (segments) per forward/backward at most")
    micro_batch_tokens: int | None = Field(
        1024,  # directory shape, SmolLM2-135M fp32: peak RSS 2.9 GB at 1024, 4.7 GB at 2048 (bench)
        ge=16,
        description="padded token positions per forward/backward at most (rows x longest row; a longer "
        "row runs alone): bounds activation memory; None = micro_batch_size alone",
    )
    merge_calls: bool = Field(
        True,
        description="merge a run's calls token-exactly into segments (a call whose prompt extends the "
        "previous prompt + sampled ids is appended); false = one sample per call (docs/training-segments.md)",
    )
    loss_weighting: Literal["run", "per_call"] = Field(
        "run",
        description="what a loss's 'sequence' is: run = one trajectory (GRPO's o_i), per_call = each call "
        "(the behaviour before merged segments)",
    )
    completion_budget: int | None = Field(
        None,
        ge=1,
        description="dr_grpo's constant normalizer, in sampled tokens per run; None = the step's largest "
        "sum of a run's requested max_tokens (loss_weighting=per_call: max_seq_len)",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: less memory, slower (prompts not shared)"
    )
    seed: int = Field(0, description="torch seed of the trainer")
    # checkpoints and publishing
    checkpoint_dir: str = Field("checkpoints", description="folder holding {policy}/step-NNNN/ checkpoints")
    keep_checkpoints: int = Field(
        3, ge=1, description="newest checkpoints kept on disk (and adapters served)"
    )
    keep_best: bool = Field(
        True,
        description="also keep the checkpoint whose adapter scored the best mean reward on validation runs "
        "(X-Split: val; the `validation` view), however old",
    )
    val_min_runs: int = Field(
        1, ge=1, description="validation runs an adapter step needs before it can be the best checkpoint"
    )
    unload_grace: float = Field(
        30.0, ge=0, description="seconds an old adapter stays loaded after a newer one"
    )
    poll_interval: float = Field(1.0, gt=0, description="seconds between looks for ready groups")
    train_threads: int | None = Field(
        None, ge=1, description="torch threads for training; None = torch's default"
    )
    # where each step's metrics also go (training_steps always has them); see trainer/reporting.py
    report_to: str = Field(
        "",
        description="comma list of trackers that also get each step's metrics: tensorboard, wandb, mlflow "
        "(pip install 'rlproxy[tensorboard]', ...); empty = the database only",
    )
    metrics_log_dir: str = Field(
        "logs", description="folder of TensorBoard event files ({dir}/{policy}/) and W&B's local files"
    )

    @field_validator("report_to")
    @classmethod
    def _known_trackers(cls, value: str) -> str:
        return ",".join(parse_report_to(value))
