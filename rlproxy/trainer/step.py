"""One GRPO optimizer step on a LoRA adapter, from rewarded runs to updated weights.

Synchronous torch code: the service calls it from its one trainer thread, never on the event loop.
The phases run in a fixed order, one comment each: advantages → batch → reference log-probs (only
with a KL term) → forward/backward with gradient accumulation → clip → optimizer step → log.
The math lives in `losses.py`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlproxy.errors import TrainerError
from rlproxy.storage.training import RunData
from rlproxy.trainer import losses
from rlproxy.trainer.batches import Batch, build_samples, micro_batches
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import reference_logprobs, token_logprobs, trainable_parameters

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step did: the numbers of a `training_steps` row and its namespaced metrics."""

    num_groups: int
    num_runs: int
    num_tokens: int  # sampled tokens trained on
    mean_reward: float
    loss: float
    metrics: dict[str, float]


def make_optimizer(model: Any, config: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW over the LoRA weights only."""
    return torch.optim.AdamW(
        trainable_parameters(model), lr=config.learning_rate, weight_decay=config.weight_decay
    )


def train_step(
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    runs: list[RunData],
    config: TrainerConfig,
    current_step: int = 0,
) -> StepResult:
    """Train one step on `runs` (all of one policy; their group_id says which group each is in).

    `current_step` is the adapter step being improved (0 = base): the policy lag of a sample is
    current_step minus the step that sampled it.
    """
    started = time.perf_counter()
    model.train()

    # 1. advantages: each run's reward normalized within its group
    group_ids = list(dict.fromkeys(r.group_id for r in runs))
    group_index = torch.tensor([group_ids.index(r.group_id) for r in runs])
    rewards = torch.tensor([r.reward for r in runs], dtype=torch.float64)
    adv, metrics = losses.advantages(rewards, group_index, config.scale_rewards)
    adv_of = {r.run_id: float(a) for r, a in zip(runs, adv.tolist(), strict=True)}

    # 2. batch: every sampled completion is a sample carrying its run's advantage
    samples, counts = build_samples(runs, adv_of, tokenizer, config.max_seq_len)
    if not samples:
        raise TrainerError(f"none of {len(runs)} runs has a completion to train on")
    batches = micro_batches(samples, config.micro_batch_size, tokenizer.pad_token_id)
    total_tokens = sum(b.num_tokens for b in batches)
    metrics.update(counts.metrics())

    # 3. reference log-probs: the base model (adapter off), only when the KL term is on
    ref: list[torch.Tensor | None] = [None] * len(batches)
    if config.beta > 0:
        ref = [reference_logprobs(model, b) for b in batches]

    # 4. forward/backward with gradient accumulation: each micro-batch's mean loss is weighted so
    #    the summed gradient is the gradient of the whole step's loss (by sequences, or by tokens for dapo)
    optimizer.zero_grad(set_to_none=True)
    loss_total = 0.0
    sums: dict[str, float] = {}
    for batch, ref_logp in zip(batches, ref, strict=True):
        logp = token_logprobs(model, batch)  # (B, C)
        old_logp = _old_or_current(batch, logp)
        loss, m = losses.policy_loss(
            logp,
            old_logp,
            ref_logp,
            batch.advantages.to(logp.device),
            batch.mask.to(logp.device),
            kind=config.loss,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            beta=config.beta,
            max_len=config.max_seq_len,
        )
        w = losses.batch_weight(config.loss, batch.mask, len(samples), total_tokens)
        (loss * w).backward()
        loss_total += loss.item() * w
        share = batch.num_tokens / max(total_tokens, 1)  # metrics: token-weighted means
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v * share

    # 5. clip: one global grad-norm bound keeps a lucky group from blowing up the adapter
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), config.max_grad_norm)

    # 6. optimizer step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    # 7. log: the same numbers go to the progress line and training_steps.metrics
    seconds = time.perf_counter() - started
    lags = [current_step - s.policy_step for s in samples]
    input_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    metrics.update(sums)
    metrics.update(
        {
            "loss/total": loss_total,
            "loss/grad_norm": float(grad_norm),
            "perf/seconds": seconds,
            "perf/input_tokens": float(input_tokens),
            "perf/tokens_per_s": input_tokens / max(seconds, 1e-9),
            "perf/micro_batches": float(len(batches)),
            "perf/policy_lag_mean": sum(lags) / len(lags),
            "perf/policy_lag_max": float(max(lags)),
            "reward/groups": float(len(group_ids)),
        }
    )
    return StepResult(
        num_groups=len(group_ids),
        num_runs=len(runs),
        num_tokens=total_tokens,
        mean_reward=float(rewards.mean()),
        loss=loss_total,
        metrics=metrics,
    )


def _old_or_current(batch: Batch, logp: torch.Tensor) -> torch.Tensor:
    """Stored sampling logprobs; where unknown (rebuilt samples), the current ones: ratio 1, on-policy."""
    old = batch.old_logp.to(logp.device)
    return torch.where(torch.isnan(old), logp.detach(), old)
