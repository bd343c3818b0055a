"""Per-row sampling: the parameters of one generation and the pure function that picks a token.

Every row owns its `torch.Generator`, seeded from the request, so a seeded row draws the same
tokens whatever else shares its batch. Logprobs are taken from the raw model distribution (before
temperature and top-p), which is what vLLM returns by default and what the trainer's importance
ratio expects.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM uses the same cut-off)


@dataclass
class SamplingParams:
    """What one request asks of the sampler; validated by the HTTP layer before it gets here."""

    max_tokens: int | None = None  # None = until the context is full
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position, 0..20


@dataclass
class TokenLogprob:
    """The sampled token's raw logprob and the `top` most likely alternatives as (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def make_generator(seed: int | None, index: int) -> torch.Generator:
    """A CPU generator for choice `index`; choice i of a seeded request uses seed + i."""
    gen = torch.Generator()
    gen.manual_seed((seed + index) % (2**63) if seed is not None else random.getrandbits(63))
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token id from a row's logits `(V,)` with temperature and top-p."""
    if params.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # (V,)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (cum - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        pick = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[pick])
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logprobs: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """The raw logprob of `token_id` in a row's log-softmax `(V,)`, plus the `top` best alternatives."""
    alts: list[tuple[int, float]] = []
    if top > 0:
        values, ids = torch.topk(logprobs, top)
        alts = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
    return TokenLogprob(token_id, float(logprobs[token_id]), alts)
