"""Stored completions -> one sample per call -> padded tensors: the per-call form and its helpers.

train_step merges a run's calls into segments (segments.py, rows.py); this per-call form remains for
what works call by call: the helpers segments.py shares (a choice's ids and stored logprobs with
their validity, `read_choice`; temperature; the chat-template fallback), the baseline groups, SFT's
example reading (sft.py; its forward runs on rows.py's rows), and the tests' oracle of the per-call
gradient (tests/trainer/test_merged_step.py).

Every choice of every completion of a run is one sample carrying the run's advantage. Its input is
the exact prompt the server saw plus the tokens it sampled (`prompt_token_ids` + `token_ids`; a
batched /v1/completions stores one prompt per choice), and the loss covers only the sampled tokens.
A completion stored without token ids (an upstream that cannot return them) is rebuilt from its
request and reply with the chat template, and counted: that is a fallback, retokenized text is not
what the model sampled. Samples longer than `max_seq_len` are
cut at the end and counted; a prompt that alone fills `max_seq_len` leaves nothing to learn from and
is dropped, and counted. So is a sample whose stored logprobs are broken (a null, -inf or a
stand-in like -9999 for a token that was sampled, so cannot have had probability 0), one drawn more
than `max_policy_lag` adapter steps ago, and, with `overlong_filter`, one cut by a length limit.
Each sample keeps its request's sampling temperature: the policy trained is the tempered one.

Layout (like TRL's): prompts left-padded to P, completions right-padded to C, so every completion
starts at column P and the model only needs logits for the last C + 1 positions. The samples of a
group usually share their prompt token for token; each distinct prompt is also kept once
(`prompt_ids`, `prompt_index`) so the model can run it once per micro-batch instead of once per
sample (see model.completion_logits).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlproxy.storage.training import CompletionData, RunData

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -1e3  # below this a sampled token's logprob is a stand-in for -inf (vLLM's -9999), not data
GREEDY_BELOW = 1e-5  # the serving engines' cut-off: below it sampling is argmax, and trains as T = 1


@dataclass
class Sample:
    """One sampled completion to train on."""

    run_id: str
    advantage: float
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # NaN where the sampling logprob is unknown (then the ratio is taken as 1)
    policy_step: int = 0  # adapter step that sampled it (0 = base model)
    temperature: float = 1.0  # the request's sampling temperature
    rebuilt: bool = False
    truncated: bool = False

    @property
    def positions(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class SampleCounts:
    """What building the samples had to do; reported in the step's metrics under batch/."""

    samples: int = 0
    rebuilt: int = 0
    truncated: int = 0
    dropped: int = 0
    missing_logprobs: int = 0  # samples whose stored logprobs were absent or did not match the tokens
    invalid_logprobs: int = 0  # samples left out: a stored logprob null, non-finite or below LOGPROB_FLOOR
    stale: int = 0  # samples left out: drawn more than max_policy_lag adapter steps ago
    overlong: int = 0  # samples left out by overlong_filter
    sampled_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        return {f"batch/{k}": float(v) for k, v in self.__dict__.items()}


@dataclass
class Batch:
    """Padded tensors of a list of samples. B samples, P prompt columns, C completion columns."""

    input_ids: Tensor  # (B, P + C)
    attention_mask: Tensor  # (B, P + C)
    position_ids: Tensor  # (B, P + C) counted from each sample's first real token
    completion_ids: Tensor  # (B, C) the sampled tokens
    mask: Tensor  # (B, C) 1.0 on sampled tokens
    old_logp: Tensor  # (B, C) stored sampling logprobs, NaN where unknown
    advantages: Tensor  # (B,)
    samples: list[Sample] = field(default_factory=list)
    prompt_ids: Tensor | None = None  # (U, P) the U distinct prompts, left-padded
    prompt_mask: Tensor | None = None  # (U, P)
    prompt_index: Tensor | None = None  # (B,) row of each sample's prompt in prompt_ids
    temperature: Tensor | None = None  # (B,) sampling temperatures; None when all are 1

    @property
    def shared_prompts(self) -> bool:
        """True when some samples share a prompt (then running each prompt once saves work)."""
        return self.prompt_ids is not None and self.prompt_ids.shape[0] < self.input_ids.shape[0]

    @property
    def completion_len(self) -> int:
        return self.completion_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())


def baseline_group(run: RunData) -> tuple[bool, str | None]:
    """The key of the runs whose rewards make `run`'s baseline (its advantage is normalized among them).

    A run's group (policy, group_id: one policy per step); for an `ungrouped` run (singletons=train)
    all the ungrouped runs of its step: one baseline, the batch's mean reward, and with
    scale_rewards=group the batch's std. That is GRPO's formula with the batch as the group:
    REINFORCE++'s global advantage normalization for one sample per prompt (Hu 2025, arXiv:2501.03262).
    """
    return (True, None) if run.ungrouped else (False, run.group_id)


def baseline_index(runs: list[RunData]) -> tuple[list[tuple[bool, str | None]], Tensor]:
    """The distinct baseline groups of `runs` in order of appearance, and each run's (R,) index into
    them: the `group_index` of losses.advantages."""
    keys = list(dict.fromkeys(baseline_group(r) for r in runs))
    row = {k: i for i, k in enumerate(keys)}
    return keys, torch.tensor([row[baseline_group(r)] for r in runs], dtype=torch.long)


def rebuild_with_template(tokenizer: Any, comp: CompletionData, choice: int) -> tuple[list[int], list[int]]:
    """Prompt and completion token ids of a completion stored without them, via the chat template."""
    request, response = comp.request or {}, comp.response or {}
    prompt: Any = None  # token ids, when a completions request sent them instead of text
    choices = response.get("choices") or []
    picked = choices[choice] if choice < len(choices) else {}
    if "messages" in request:
        tools = request.get("tools") or None
        reply = dict(picked.get("message") or {"role": "assistant", "content": ""})
        reply = {k: v for k, v in reply.items() if k in ("role", "content", "tool_calls", "name")}
        reply["role"] = "assistant"
        prompt_text = tokenizer.apply_chat_template(
            request["messages"], tools=tools, add_generation_prompt=True, tokenize=False
        )
        full_text = tokenizer.apply_chat_template(request["messages"] + [reply], tools=tools, tokenize=False)
        if full_text.startswith(prompt_text):
            completion_text = full_text[len(prompt_text) :].rstrip("\n")
        else:  # a template that rewrites earlier turns: fall back to the reply's text
            completion_text = reply.get("content") or ""
    else:
        prompt = request.get("prompt") or ""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # batched prompts
            prompt = prompt[min(choice // max(int(request.get("n") or 1), 1), len(prompt) - 1)]
        prompt_text, prompt = (prompt, None) if isinstance(prompt, str) else ("", prompt)
        completion_text = picked.get("text") or ""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return (list(prompt) if isinstance(prompt, list) else encode(prompt_text)), encode(completion_text)


def prompt_ids(comp: CompletionData, choice: int) -> list[int] | None:
    """The prompt of one choice: the stored list, or its own entry when there is one list per choice."""
    p = comp.prompt_token_ids
    if p and isinstance(p[0], list | None):  # a batched /v1/completions: one prompt per choice
        return list(p[choice]) if choice < len(p) and p[choice] is not None else None
    return list(p) if p is not None else None


def sampling_temperature(request: dict[str, Any] | None, default: float = 1.0) -> float:
    """The temperature a completion was sampled at: the request's, else the server's `default`.

    Greedy requests (T ~ 0) train the untempered policy (T = 1): argmax has no distribution to divide.
    """
    t = (request or {}).get("temperature")
    t = default if t is None else float(t)
    return t if t >= GREEDY_BELOW else 1.0


def _finish_reason(comp: CompletionData, choice: int) -> str | None:
    choices = (comp.response or {}).get("choices") or []
    return choices[choice].get("finish_reason") if choice < len(choices) else None


def _old_logprobs(comp: CompletionData, choice: int, n: int) -> list[float] | None:
    """The stored sampling logprobs of a choice; None when absent, NaN entries where broken."""
    lps = (comp.logprobs or [None])[choice] if comp.logprobs and choice < len(comp.logprobs) else None
    if lps is None or len(lps) != n:
        return None
    # orjson stores -inf as null; servers send -9999 for -inf: the token was sampled, so neither is data
    return [float(x) if x is not None and LOGPROB_FLOOR < float(x) < math.inf else math.nan for x in lps]


@dataclass
class Choice:
    """One choice of a stored completion as training reads it: exact ids, or the template's fallback."""

    prompt: list[int]
    completion: list[int]
    old: list[float] | None  # stored sampling logprobs (NaN entries where broken); None when absent
    rebuilt: bool  # re-tokenized by the chat template (no stored token ids)

    @property
    def broken_logprobs(self) -> bool:
        """A sampled token's stored logprob is null, non-finite or a stand-in: no ratio of it is trusted."""
        return self.old is not None and any(math.isnan(x) for x in self.old)


def read_choice(tokenizer: Any, comp: CompletionData, choice: int) -> Choice:
    """Choice `choice` of `comp`: its stored prompt and sampled ids with their logprobs, or, stored
    without token ids, the chat template's rebuild (no logprobs). Shared by the per-call samples
    (`build_samples`) and the merged segments (segments.build_segments)."""
    tokens = comp.token_ids[choice] if comp.token_ids and choice < len(comp.token_ids) else None
    prompt = prompt_ids(comp, choice)
    if prompt is not None and tokens is not None:
        return Choice(prompt, list(tokens), _old_logprobs(comp, choice, len(tokens)), rebuilt=False)
    prompt, completion = rebuild_with_template(tokenizer, comp, choice)
    return Choice(prompt, completion, None, rebuilt=True)


def usable(comp: CompletionData) -> bool:
    """True when a completion holds something the model sampled: token ids, or at least a reply.
    A hosted provider's reply (source `hosted`) is another model's text: never a GRPO sample."""
    if comp.status == "error" or comp.source == "hosted":
        return False
    if comp.prompt_token_ids and any(comp.token_ids or []):
        return True
    return bool((comp.response or {}).get("choices"))


def build_samples(
    runs: list[RunData],
    advantages: dict[str, float],
    tokenizer: Any,
    max_seq_len: int,
    *,
    current_step: int = 0,
    max_policy_lag: int | None = None,
    overlong_filter: bool = False,
    default_temperature: float = 1.0,
) -> tuple[list[Sample], SampleCounts]:
    """One sample per choice of every completion of every run, with the run's advantage.

    `current_step` is the adapter step being trained (a sample's lag is current_step - its policy_step);
    `default_temperature` is the server's, for requests that did not set one.
    """
    samples: list[Sample] = []
    counts = SampleCounts()
    for run in runs:
        for comp in run.completions:
            if not usable(comp):
                continue
            if max_policy_lag is not None and current_step - (comp.policy_step or 0) > max_policy_lag:
                counts.stale += len(comp.token_ids or []) or 1
                continue
            n_choices = max(len(comp.token_ids or []), len((comp.response or {}).get("choices") or []), 1)
            for choice in range(n_choices):
                c = read_choice(tokenizer, comp, choice)
                prompt, completion, old, rebuilt = c.prompt, c.completion, c.old, c.rebuilt
                if not completion:
                    continue  # nothing sampled (e.g. cancelled before the first token)
                if c.broken_logprobs:
                    # like verl's veto: the record does not describe its sampler, so no ratio of it is trusted
                    counts.invalid_logprobs += 1
                    log.warning("run %s: a sampled token has no valid logprob; sample left out", run.run_id)
                    continue
                if old is None:
                    counts.missing_logprobs += 1
                    old = [math.nan] * len(completion)
                truncated = len(prompt) + len(completion) > max_seq_len
                if len(prompt) >= max_seq_len:
                    counts.dropped += 1
                    log.warning(
                        "run %s: a prompt of %d tokens fills max_seq_len; sample dropped",
                        run.run_id,
                        len(prompt),
                    )
                    continue
                if overlong_filter and (truncated or _finish_reason(comp, choice) == "length"):
                    counts.overlong += 1  # DAPO: a cut answer's reward says little about its tokens
                    continue
                if truncated:
                    keep = max_seq_len - len(prompt)
                    completion, old = completion[:keep], old[:keep]
                samples.append(
                    Sample(
                        run_id=run.run_id,
                        advantage=advantages[run.run_id],
                        prompt_ids=prompt,
                        completion_ids=completion,
                        old_logprobs=old,
                        policy_step=comp.policy_step or 0,
                        temperature=sampling_temperature(comp.request, default_temperature),
                        rebuilt=rebuilt,
                        truncated=truncated,
                    )
                )
                counts.samples += 1
                counts.rebuilt += rebuilt
                counts.truncated += truncated
                counts.sampled_tokens += len(completion)
    return samples, counts


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """Pad samples into one Batch: prompts left-padded, completions right-padded."""
    B = len(samples)
    P = max(len(s.prompt_ids) for s in samples)
    C = max(len(s.completion_ids) for s in samples)
    input_ids = torch.full((B, P + C), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + C), dtype=torch.long)
    completion_ids = torch.full((B, C), pad_id, dtype=torch.long)
    mask = torch.zeros((B, C), dtype=torch.float32)
    old_logp = torch.zeros((B, C), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, P - p : P] = torch.tensor(s.prompt_ids)
        input_ids[i, P : P + c] = torch.tensor(s.completion_ids)
        attention_mask[i, P - p : P + c] = 1
        completion_ids[i, :c] = torch.tensor(s.completion_ids)
        mask[i, :c] = 1.0
        old_logp[i, :c] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P + C)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    temps = [s.temperature for s in samples]
    temperature = torch.tensor(temps, dtype=torch.float32) if any(t != 1.0 for t in temps) else None
    distinct = list(dict.fromkeys(tuple(s.prompt_ids) for s in samples))
    row = {p: i for i, p in enumerate(distinct)}
    prompt_index = torch.tensor([row[tuple(s.prompt_ids)] for s in samples])
    prompt_ids = input_ids[:, :P][_first_rows(prompt_index, len(distinct))]  # (U, P)
    prompt_mask = attention_mask[:, :P][_first_rows(prompt_index, len(distinct))]  # (U, P)
    return Batch(
        input_ids, attention_mask, position_ids, completion_ids, mask, old_logp, adv, samples,
        prompt_ids, prompt_mask, prompt_index, temperature,
    )  # fmt: skip


def _first_rows(index: Tensor, n: int) -> Tensor:
    """For each of the n distinct values of `index`, the first row holding it."""
    return torch.tensor([int((index == u).nonzero()[0]) for u in range(n)])


def micro_batches(samples: list[Sample], size: int, pad_id: int) -> list[Batch]:
    """Samples sorted by length and cut into padded micro-batches of `size` (less padding, same math)."""
    ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids), reverse=True)
    return [collate(ordered[i : i + size], pad_id) for i in range(0, len(ordered), size)]
