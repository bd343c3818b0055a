"""The GRPO math as pure functions: group-relative advantages and the clipped policy losses.

Read top to bottom, like the papers:

    advantages      A_i = (r_i - mean(r_group)) / (std(r_group) + eps)        (scale_rewards=group)
    policy          log pi(y_t) = log_softmax(logits / T)[y_t], T the request's temperature (TRL, verl)
    log-ratio       log rho_t = log pi(y_t) - log pi_old(y_t)        (pi_old: the stored sampling logprobs)
    ratio           rho_t = exp(log rho_t)         gspo: rho = exp(mean_t log rho_t), one per sequence
    surrogate       l_t = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps_high) A)
    dual clip       l_t = min(l_t, -C A) where A < 0   (C = ratio_cap: stale samples cannot take C x the step)
    KL (k3)         kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (Schulman's k3, >= 0)
    per token       l_t + beta kl_t
    loss            sum_t w_t l_t (token_policy_loss), the weights w_t set when the batch is built
                    (segments.assign_weights), so that the sum is each loss's aggregation:
                    grpo    mean over sequences of the per-sequence token mean
                    dr_grpo sum over all tokens / (sequences * max_len)  (max_len a constant: no length bias)
                    dapo    mean over all tokens of the batch (long answers weigh by their length)
                    gspo    mean over sequences (the ratio is already per sequence)

Shapes: `N` trained tokens of a step's micro-batch, flat; `R` runs.
Nothing here knows about models, batches or storage; tests/trainer/test_losses.py checks exact numbers.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor

from rlproxy.settings import LossKind  # the one list of loss names (the `loss` setting's)

ADV_EPS = 1e-4  # TRL's epsilon: keeps A finite when a group's std is tiny
ZERO_STD = 1e-6  # below this a group's rewards count as all equal
ADV_MAX = 1e6  # scale_rewards=none: the largest |advantage| kept as is (float32 holds it exactly enough)
# (epsilon, epsilon_high) each loss's paper uses: DAPO's clip-higher; GSPO's sequence ratio is a
# geometric mean of token ratios, so it moves ~100x less than one token's and 0.2 would never clip
CLIP_DEFAULTS: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
}


def clip_range(kind: LossKind, epsilon: float | None, epsilon_high: float | None) -> tuple[float, float]:
    """(eps_low, eps_high) of the clipped surrogate: the settings where given, else the loss's defaults."""
    low, high = CLIP_DEFAULTS[kind]
    if epsilon is not None:
        low = high = epsilon  # one epsilon given: symmetric unless epsilon_high says otherwise
    return low, high if epsilon_high is None else epsilon_high


def sampled_logprobs(logits: Tensor, targets: Tensor, temperature: Tensor | None = None) -> Tensor:
    """log_softmax(logits / T) at `targets` (B, C), without materializing the (B, C, V) log-probabilities.

    logits (B, C, V); temperature (B,) per sample, or None for T = 1 (the raw distribution).
    """
    logits = logits.float()
    if temperature is not None:
        logits = logits / temperature.to(logits).view(-1, 1, 1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def behavior_logprobs(
    logp: Tensor, raw_logp: Tensor, stored: Tensor, mode: Literal["raw", "processed"]
) -> Tensor:
    """The pi_old to divide by, given the stored sampling logprobs (NaN = unknown: ratio 1).

    processed: the server stored log pi_T, the tempered policy that sampled: use it as is.
    raw: it stored log_softmax(logits) before temperature, so the ratio's value is taken where both
    sides are known, raw against raw, while its gradient stays that of the tempered policy:
    logp - old = logp_T - sg(logp_T) + sg(raw - stored). At T = 1 both modes are the same.
    """
    logp = logp.detach()
    old = stored if mode == "processed" else logp - (raw_logp.detach() - stored)
    return torch.where(torch.isnan(stored), logp, old)


def approx_kl(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """cleanrl's approximate KL(pi_old || pi) = E[(rho - 1) - log rho] over the masked tokens; >= 0."""
    return masked_mean(torch.expm1(log_ratio) - log_ratio, mask)


def advantages(
    rewards: Tensor, group_index: Tensor, scale_rewards: Literal["group", "none"] = "group"
) -> tuple[Tensor, dict[str, float]]:
    """Group-relative advantages for `rewards` (R,) where `group_index` (R,) numbers each run's group 0..G-1.

    The std is the unbiased sample std of the group (TRL's choice). Returns the advantages (R,) and
    reward/ metrics, including the fraction of groups whose rewards were all equal (they carry no gradient).
    """
    rewards = rewards.to(torch.float64)
    # any finite rewards: computed on rewards / s (s = the largest |reward|), so no sum or square
    # overflows; (r - mean) / (std + eps) is the same number as (r/s - mean/s) / (std/s + eps/s)
    s = float(rewards.abs().max().item()) if rewards.numel() else 1.0
    s = s if math.isfinite(s) and s > 1.0 else 1.0
    scaled = rewards / s
    num_groups = int(group_index.max().item()) + 1
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, scaled) / count
    centered = scaled - mean[group_index]  # (R,) in units of s
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, centered**2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()  # (G,) unbiased, in units of s
    if scale_rewards == "group":
        adv = centered / (std[group_index] + ADV_EPS / s)
    else:
        # unscaled advantages are rewards' size: beyond ADV_MAX they are scaled down together (same
        # direction; a gradient that large is cut by max_grad_norm anyway), so float32 cannot overflow
        adv = centered * min(s, ADV_MAX / max(float(centered.abs().max()), 1e-300))
    metrics = {
        "reward/mean": float(scaled.mean()) * s,
        "reward/std": float(scaled.std()) * s if rewards.numel() > 1 else 0.0,
        "reward/group_std_mean": float(std.mean()) * s,
        "reward/frac_zero_std": (std * s < ZERO_STD).to(torch.float64).mean().item(),
    }
    return adv.to(torch.float32), metrics


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(d) - d - 1, d = ref - logp; unbiased, >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over the positions where `mask` is 1 (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def token_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    adv: Tensor,
    weight: Tensor,
    kind: LossKind = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ratio_cap: float | None = None,
    ratio_group: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped surrogate over N trained tokens, each with its own weight: loss = sum_t w_t l_t.

    logp, old_logp, ref_logp, adv, weight are (N,)
    (one entry per trained token; adv is its run's advantage). The weights were decided when the batch
    was built (segments.assign_weights): summed over every micro-batch of the step they give the step's
    loss, so micro-batches are summed as they are. gspo: `ratio_group` (N,) numbers each token's ratio
    (0..G-1; its segment or call): the ratio is exp(mean log-ratio) over the group, one per group.
    Metrics are means over the N tokens (a caller weighs micro-batches by their token counts).
    """
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    a = adv.to(logp.dtype)
    log_ratio = logp - old_logp  # (N,)
    if kind == "gspo":
        if ratio_group is None:
            raise ValueError("gspo needs ratio_group: the sequence each token's ratio belongs to")
        g = int(ratio_group.max().item()) + 1 if ratio_group.numel() else 0
        count = torch.zeros(g, dtype=logp.dtype, device=logp.device).index_add_(
            0, ratio_group, torch.ones_like(logp)
        )
        mean = torch.zeros(g, dtype=logp.dtype, device=logp.device).index_add_(0, ratio_group, log_ratio)
        log_ratio = (mean / count.clamp(min=1))[ratio_group]  # (N,) each token carries its group's ratio
    ratio = torch.exp(log_ratio)
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
    per_token = -torch.min(unclipped, clipped)
    if ratio_cap is not None:
        per_token = torch.where(a < 0, torch.minimum(per_token, -ratio_cap * a), per_token)
    kl = k3_kl(logp, ref_logp) if (beta > 0 and ref_logp is not None) else None
    if kl is not None:
        per_token = per_token + beta * kl
    if kind not in get_args(LossKind):
        raise ValueError(f"unknown loss kind {kind!r}; use one of {get_args(LossKind)}")
    loss = (per_token * weight.to(logp.dtype)).sum()
    with torch.no_grad():
        ones = torch.ones_like(logp)
        low = ((ratio < 1 - eps_low) & (a < 0)).to(logp.dtype)
        high = ((ratio > 1 + eps_high) & (a > 0)).to(logp.dtype)
        capped = ((ratio > (ratio_cap or math.inf)) & (a < 0)).to(logp.dtype)
        metrics = {
            "loss/policy": loss.item(),
            "kl/approx": approx_kl(log_ratio, ones).item(),
            "clip/low_frac": masked_mean(low, ones).item(),
            "clip/high_frac": masked_mean(high, ones).item(),
            "clip/frac": masked_mean(torch.maximum(low, high), ones).item(),
            "clip/ratio_mean": masked_mean(ratio, ones).item(),
            "clip/ratio_max": ratio.max().item() if ratio.numel() else 0.0,
            "clip/dual_frac": masked_mean(capped, ones).item(),
        }
        if kl is not None:
            metrics["kl/ref"] = masked_mean(kl, ones).item()
    return loss, metrics
