"""Stored completions as training reads them, call by call: what segments.py merges into rows.

A choice's ids and stored logprobs with their validity (`read_choice`), its temperature, the
chat-template fallback, and the baseline groups; SFT's example reading (sft.py) uses them too.

A choice's input is the exact prompt the server saw plus the tokens it sampled (`prompt_token_ids` +
`token_ids`; a batched /v1/completions stores one prompt per choice). A completion stored without
token ids (an upstream that cannot return them) is rebuilt from its request and reply with the chat
template, and counted: retokenized text is not what the model sampled. A stored logprob that is null,
-inf or a stand-in like -9999 for a sampled token (which cannot have had probability 0) is broken.
Each call keeps its request's sampling temperature: the policy trained is the tempered one.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlproxy.storage.training import CompletionData, RunData

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -1e3  # below this a sampled token's logprob is a stand-in for -inf (vLLM's -9999), not data
GREEDY_BELOW = 1e-5  # the serving engines' cut-off: below it sampling is argmax, and trains as T = 1


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
    without token ids, the chat template's rebuild (no logprobs)."""
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
