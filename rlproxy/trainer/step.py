"""One GRPO optimizer step on a LoRA adapter, from rewarded runs to updated weights.

Synchronous torch code: the service calls it from its one trainer thread, never on the event loop.
The phases run in a fixed order, one comment each: advantages → batch (a run's calls merged into
segments, every trained token's weight; segments.py) → reference log-probs (only with a KL term) →
forward/backward with gradient accumulation → clip → optimizer step → log. The math lives in
`losses.py`; the forward (decoder body, LM head in chunks, never (B, T, V) logits) in `model.py`.

A step whose loss or gradient norm is not finite changes nothing (no optimizer step: the service
then neither checkpoints nor publishes, and its runs stay trainable); `step/skipped_nonfinite` says so.
Samples drawn by the weights being trained (lag 0) must agree with their stored logprobs: when their
approximate KL is far from 0 the backend's logprob mode is not `sampling_logprobs` (or it truncates
with top-p/top-k), and `kl/lag0` with a warning says so.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlproxy.errors import TrainerError
from rlproxy.storage.step_columns import STEP_COLUMNS
from rlproxy.storage.step_columns import step_columns as step_columns  # re-exported: service, offline
from rlproxy.storage.training import RunData
from rlproxy.trainer import losses
from rlproxy.trainer.batches import baseline_index
from rlproxy.trainer.config import TrainerConfig, learning_rate_for
from rlproxy.trainer.model import (
    StepPrefixes,
    default_temperature,
    gradient_checkpointing,
    reference_row_logprobs,
    row_logprobs,
    trainable_parameters,
)
from rlproxy.trainer.rows import micro_batches_by_tokens
from rlproxy.trainer.segments import assign_weights, build_segments, default_budget


class Ranks(Protocol):
    """What a step needs of a `rlproxy train --nproc N` job (distributed.Ranks is one): declared here so
    that step.py imports nothing of distributed.py (which imports this module to run steps)."""

    @property
    def leader(self) -> bool: ...

    def share(self, samples: list[Any], runs: list[RunData]) -> list[Any]: ...

    def reduce(
        self, model: Any, loss: float, sums: dict[str, float], lag0: tuple[float, float], micro: int
    ) -> tuple[float, dict[str, float], tuple[float, float], int]: ...


log = logging.getLogger(__name__)

LAG0_MISMATCH_KL = 0.02  # per token; bf16 serving vs fp32 training stays ~1e-3, a mode mismatch far above
LAG0_MIN_TOKENS = 16  # fewer lag-0 tokens are too few to judge


class StaleRuns(TrainerError):
    """Every sample of a step was drawn more than `max_policy_lag` adapter steps ago."""


@dataclass
class StepResult:
    """What one step did: the numbers of a `training_steps` row and its namespaced metrics."""

    num_groups: int
    num_runs: int
    num_tokens: int  # sampled tokens trained on
    mean_reward: float
    loss: float
    metrics: dict[str, float]
    skipped: bool = False  # the loss or the gradient was not finite: no optimizer step was taken
    # per run: (segments trained, JSON list of its breaks or None): runs.segments / runs.segment_breaks
    run_segments: dict[str, tuple[int, str | None]] = field(default_factory=dict)


def make_optimizer(model: Any, config: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW over the LoRA weights only; learning_rate None = by the model's hidden size."""
    lr = config.learning_rate
    if lr is None:
        cfg = model.config
        text_config = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg  # multimodal: its LM
        lr = learning_rate_for(getattr(text_config, "hidden_size", None))
        log.info("learning rate %g (by model size; set learning_rate to choose)", lr)
    return torch.optim.AdamW(trainable_parameters(model), lr=lr, weight_decay=config.weight_decay)


def train_step(
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    runs: list[RunData],
    config: TrainerConfig,
    current_step: int = 0,
    ranks: Ranks | None = None,
) -> StepResult:
    """Train one step on `runs` (all of one policy; their group_id says which group each is in).

    `current_step` is the adapter step being improved (0 = base): the policy lag of a sample is
    current_step minus the step that sampled it. With `ranks` (a `rlproxy train --nproc N` job) this
    rank runs only its share of the samples and the gradients are summed over ranks before the clip;
    only rank 0 steps the optimizer (distributed.py).
    """
    started = time.perf_counter()
    model.train()
    eps_low, eps_high = losses.clip_range(config.loss, config.epsilon, config.epsilon_high)

    # 1. advantages: each run's reward normalized within its group (ungrouped runs: within their batch)
    group_ids, group_index = baseline_index(runs)
    rewards = torch.tensor([r.reward for r in runs], dtype=torch.float64)
    adv, metrics = losses.advantages(rewards, group_index, config.scale_rewards)
    if any(r.weight != 1.0 for r in runs):
        # a run's weight (a sibling group's: siblings_weight, against an app run group's 1) scales its
        # advantage after the normalization: the baseline is still its own group's mean
        adv = adv * torch.tensor([r.weight for r in runs], dtype=adv.dtype)
    adv_of = {r.run_id: float(a) for r, a in zip(runs, adv.tolist(), strict=True)}

    # 2. batch: each run's calls merged token-exactly into segments (segments.py), every trained
    #    token's loss weight decided here, then rows in micro-batches by a token budget (rows.py)
    segments, counts = build_segments(
        runs,
        adv_of,
        tokenizer,
        config.max_seq_len,
        current_step=current_step,
        max_policy_lag=config.max_policy_lag,
        overlong_filter=config.overlong_filter,
        default_temperature=default_temperature(model),
        merge=config.merge_calls,
    )
    if not segments and counts.stale:
        raise StaleRuns(f"all {counts.stale} samples of {len(runs)} runs are older than max_policy_lag")
    if not segments:
        raise TrainerError(f"none of {len(runs)} runs has a completion to train on")
    budget = config.completion_budget or default_budget(runs)
    assign_weights(
        segments, config.loss, config.loss_weighting, max_seq_len=config.max_seq_len, completion_budget=budget
    )
    total_tokens = sum(s.num_trained for s in segments)  # the step's, on every rank
    mine = segments if ranks is None else ranks.share(segments, runs)
    ratio_by = "call" if config.loss_weighting == "per_call" else "segment"
    batches = (
        micro_batches_by_tokens(
            mine,
            tokenizer.pad_token_id,
            max_rows=config.micro_batch_size,
            max_tokens=config.micro_batch_tokens,
            ratio_by=ratio_by,
        )
        if mine
        else []
    )
    metrics.update(counts.metrics())

    # 3. reference log-probs: the base model (adapter off), only when the KL term is on
    ref: list[torch.Tensor | None] = [None] * len(batches)
    if config.beta > 0:
        ref = [reference_row_logprobs(model, b) for b in batches]

    # 4. forward/backward with gradient accumulation: every token's weight already divides by the
    #    step's totals, so the micro-batches' losses simply add up to the step's loss
    optimizer.zero_grad(set_to_none=True)
    loss_total = 0.0
    sums: dict[str, float] = {}
    lag0_kl, lag0_tokens = 0.0, 0.0
    positions_run = 0
    # a prefix several micro-batches share runs once, its backward after theirs (StepPrefixes)
    checkpointed = gradient_checkpointing(model)  # no KV cache: every row runs whole
    prefixes = StepPrefixes(model, [] if checkpointed else batches)
    for batch, ref_logp in zip(batches, ref, strict=True):
        if not batch.num_tokens:
            continue  # nothing trained in it (a sampled token at position 0 has nothing to predict it)
        prefix = None if checkpointed else prefixes.enter(batch)
        positions_run += batch.positions if checkpointed else batch.positions_run(prefix is not None)
        logp, raw, entropy, _ = row_logprobs(model, batch, prefix=prefix)  # (N,) tempered; raw at T = 1
        stored = batch.old_logp.to(logp.device)
        old_logp = losses.behavior_logprobs(logp, raw, stored, config.sampling_logprobs)
        loss, m = losses.token_policy_loss(
            logp,
            old_logp,
            ref_logp,
            batch.advantages.to(logp.device),
            batch.weight.to(logp.device),
            kind=config.loss,
            epsilon=eps_low,
            epsilon_high=eps_high,
            beta=config.beta,
            ratio_cap=config.ratio_cap,
            ratio_group=batch.ratio_group.to(logp.device),
        )
        m["entropy/mean"] = entropy.mean().item() if entropy.numel() else 0.0
        loss.backward()
        if prefix is not None:
            prefixes.leave(batch)
        loss_total += loss.item()
        share = batch.num_tokens / max(total_tokens, 1)  # metrics: token-weighted means
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v * share
        # lag-0 tokens were drawn by these very weights: their log-ratio must be ~0
        known = (batch.policy_step.to(logp.device) == current_step) & ~torch.isnan(stored)  # (N,)
        if known.any():
            kf = known.to(logp.dtype)
            lag0_kl += losses.approx_kl((logp - old_logp).detach(), kf).item() * kf.sum().item()
            lag0_tokens += kf.sum().item()

    # 4b. several ranks: sum the gradients and the scalars (each rank's loss is already divided by
    #     the step's totals, so the sum is the single-process gradient)
    n_micro = len(batches)
    if ranks is not None:
        loss_total, sums, (lag0_kl, lag0_tokens), n_micro = ranks.reduce(
            model, loss_total, sums, (lag0_kl, lag0_tokens), n_micro
        )

    # 5. clip: one global grad-norm bound keeps a lucky group from blowing up the adapter
    #    (clip_grad_norm_ returns the norm before clipping: that is the number logged)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), config.max_grad_norm)

    # 6. optimizer step, only on a finite loss and gradient: one bad sample must not wreck the adapter
    skipped = not (math.isfinite(loss_total) and math.isfinite(float(grad_norm)))
    if skipped:
        log.warning(
            "step skipped: loss %s, grad norm %s not finite; weights unchanged", loss_total, float(grad_norm)
        )
    elif ranks is None or ranks.leader:  # followers only compute: rank 0 broadcasts its weights
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    # 7. log: the same numbers go to the progress line and training_steps.metrics
    seconds = time.perf_counter() - started
    lags = [current_step - p for p in counts.policy_steps] or [0]
    input_tokens = counts.positions_merged  # the positions the forward passes ran
    metrics.update(sums)
    lag0 = lag0_kl / lag0_tokens if lag0_tokens else 0.0
    mismatch = lag0_tokens >= LAG0_MIN_TOKENS and lag0 > LAG0_MISMATCH_KL
    if mismatch:
        log.warning(
            "samples drawn by these very weights disagree with their stored logprobs (approx KL %.4f over "
            "%d tokens, expected ~0): the backend's logprobs are probably not sampling_logprobs=%s "
            "(vLLM: --logprobs-mode raw_logprobs | processed_logprobs), or it truncates with top-p/top-k",
            lag0,
            lag0_tokens,
            config.sampling_logprobs,
        )
    metrics.update(
        {
            "step/skipped_nonfinite": float(skipped),
            "kl/lag0": lag0,
            "kl/lag0_tokens": lag0_tokens,
            "kl/logprob_mismatch": float(mismatch),
            "clip/eps_low": eps_low,
            "clip/eps_high": eps_high,
            "loss/total": loss_total,
            "loss/grad_norm": float(grad_norm),
            "perf/seconds": seconds,
            "perf/input_tokens": float(input_tokens),
            # padding included, each shared prefix once
            "perf/positions_run": float(positions_run + prefixes.positions),
            "perf/tokens_per_s": input_tokens / max(seconds, 1e-9),
            "perf/micro_batches": float(n_micro),
            "perf/policy_lag_mean": sum(lags) / len(lags),
            "perf/policy_lag_max": float(max(lags)),
            "batch/completion_len_mean": counts.sampled_tokens / max(counts.samples, 1),
            "reward/groups": float(len(group_ids)),
        }
    )
    metrics["kl/step"] = metrics.get("kl/ref", metrics.get("kl/approx", 0.0))
    # the groups of this step with equal rewards; the service adds the ones it skipped before the step
    metrics.setdefault("reward/zero_variance_frac", metrics["reward/frac_zero_std"])
    return StepResult(
        num_groups=len(group_ids),
        num_runs=len(runs),
        num_tokens=total_tokens,
        mean_reward=float(rewards.mean()),
        loss=loss_total,
        metrics=metrics,
        skipped=skipped,
        run_segments=counts.run_breaks(),
    )


# The `training_steps` columns and the metric each one copies: derived from their one owner,
# storage/step_columns.py STEP_COLUMNS. `kl/step` is the KL to the base model (k3) when beta > 0, else the
# approximate KL to the sampling policy (free: no ref pass).
COLUMN_METRICS: dict[str, str] = {column: spec.metric for column, spec in STEP_COLUMNS.items()}
