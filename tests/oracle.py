"""The per-call training path, kept only as the tests' oracle (importable as `oracle`: tests/ is on sys.path).

train_step runs merged rows (segments.py, rows.py, model.row_logprobs, losses.token_policy_loss);
tests/trainer/test_merged_step.py checks that it gives the gradient of this simpler path: one sample
per call (the library's own per-call segments, `merge=False`, cut at the prompt), left-padded prompts
and right-padded completions, the full (B, C, V) logits, and the clipped surrogate as a mean per
micro-batch that `batch_weight` sums into the step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlproxy.storage.training import RunData
from rlproxy.trainer.losses import k3_kl, sampled_logprobs
from rlproxy.trainer.segments import MergeCounts, build_segments


@dataclass
class Sample:
    """One sampled call to train on."""

    run_id: str
    advantage: float
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # NaN where unknown (then the ratio is 1)
    policy_step: int = 0
    temperature: float = 1.0


def build_samples(
    runs: list[RunData], advantages: dict[str, float], tokenizer: Any, max_seq_len: int, **kw: Any
) -> tuple[list[Sample], MergeCounts]:
    """One sample per trained call of `runs` (keywords: those of segments.build_segments)."""
    segs, counts = build_segments(runs, advantages, tokenizer, max_seq_len, merge=False, **kw)
    out = []
    for s in segs:
        p = s.trained.index(True)  # merge=False: one call, its prompt as context then its sampled ids
        out.append(
            Sample(
                s.run_id,
                s.advantage,
                s.ids[:p],
                s.ids[p:],
                s.old_logprobs[p:],
                s.policy_step[p],
                s.temperature[p],
            )
        )
    return out, counts


@dataclass
class Batch:
    """B samples padded: P prompt columns (left-padded), C completion columns (right-padded)."""

    input_ids: Tensor  # (B, P + C)
    attention_mask: Tensor  # (B, P + C)
    position_ids: Tensor  # (B, P + C)
    completion_ids: Tensor  # (B, C)
    mask: Tensor  # (B, C) 1.0 on sampled tokens
    old_logp: Tensor  # (B, C)
    advantages: Tensor  # (B,)
    temperature: Tensor | None  # (B,); None when all are 1

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    @property
    def completion_len(self) -> int:
        return self.completion_ids.shape[1]


def collate(samples: list[Sample], pad_id: int) -> Batch:
    B, P = len(samples), max(len(s.prompt_ids) for s in samples)
    C = max(len(s.completion_ids) for s in samples)
    input_ids = torch.full((B, P + C), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + C), dtype=torch.long)
    completion_ids = torch.full((B, C), pad_id, dtype=torch.long)
    mask, old_logp = torch.zeros((B, C)), torch.zeros((B, C))
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, P - p : P + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attention_mask[i, P - p : P + c] = 1
        completion_ids[i, :c] = torch.tensor(s.completion_ids)
        mask[i, :c] = 1.0
        old_logp[i, :c] = torch.tensor(s.old_logprobs)
    temps = [s.temperature for s in samples]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    adv = torch.tensor([s.advantage for s in samples])
    temperature = torch.tensor(temps) if any(t != 1.0 for t in temps) else None
    return Batch(input_ids, attention_mask, position_ids, completion_ids, mask, old_logp, adv, temperature)


def micro_batches(samples: list[Sample], size: int, pad_id: int) -> list[Batch]:
    ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids), reverse=True)
    return [collate(ordered[i : i + size], pad_id) for i in range(0, len(ordered), size)]


def completion_logits(model: Any, batch: Batch) -> Tensor:
    """Logits (B, C, V) at the positions that predict the sampled tokens (every sample run whole)."""
    device = next(model.parameters()).device
    C = batch.completion_len
    out = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        logits_to_keep=C + 1,
        use_cache=False,
    )
    return out.logits[:, :-1, :]  # position P-1+t predicts completion token t


def token_logprobs(model: Any, batch: Batch) -> Tensor:
    """(B, C) log-probabilities of the sampled tokens, each sample's at its temperature."""
    logits = completion_logits(model, batch)
    return sampled_logprobs(logits, batch.completion_ids.to(logits.device), batch.temperature)


def policy_loss(
    logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor, mask: Tensor, kind: str = "grpo",
    epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0, max_len: int | None = None,
    ratio_cap: float | None = None,
) -> Tensor:  # fmt: skip
    """The clipped surrogate of one (B, T) micro-batch as a mean over it (losses.py's formulas)."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    a = adv.to(logp.dtype).unsqueeze(1)  # (B, 1)
    log_ratio = (logp - old_logp) * mask
    if kind == "gspo":
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1.0)).unsqueeze(1)  # (B, 1)
    ratio = torch.exp(log_ratio)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * a)
    if ratio_cap is not None:
        per_token = torch.where(a < 0, torch.minimum(per_token, -ratio_cap * a), per_token)
    if beta > 0 and ref_logp is not None:
        per_token = per_token + beta * k3_kl(logp, ref_logp)
    per_token = per_token.expand_as(logp) * mask
    if kind in ("grpo", "gspo"):
        return (per_token.sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    if kind == "dr_grpo":
        return per_token.sum() / (logp.shape[0] * (max_len or logp.shape[1]))
    return per_token.sum() / mask.sum().clamp(min=1.0)  # dapo


def batch_weight(kind: str, mask: Tensor, total_seqs: int, total_tokens: int) -> float:
    """A micro-batch's share of the step: by sequences, or by tokens for dapo."""
    if kind == "dapo":
        return float(mask.sum().item()) / max(total_tokens, 1)
    return mask.shape[0] / max(total_seqs, 1)
