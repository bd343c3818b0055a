"""Supervised fine-tuning (SFT) of a policy's LoRA: `rlproxy sft`, from stored runs or a chat file.

    examples ──> [per epoch] shuffle ──> optimizer steps of `batch_size` examples ──> checkpoint
             ──> backend.load_adapter (with --upstream) ──> commit (training_steps kind `sft`)
             ──> every `serve` on the store picks the step up (policies.py poll) and serves it

Examples are (context, target tokens, loss mask). From the store (`--where`, SQL over the
`trajectories` view) each stored completion is one example with its exact tokens: the prompt the
server saw (`prompt_token_ids`) as context and the tokens it sampled (`token_ids`) as the target,
every one of them learned. From a file (OpenAI chat JSONL, `{"messages": [...], "tools": [...]}`)
the chat template renders the conversation and only the assistant turns are learned, each through its
end-of-turn token (so the model also learns to stop); system, user and tool turns are context.
Distillation (`--from-policy teacher`) does the same with the store's conversations of another
policy, typically a hosted model's (text only: proxy/hosted.py): `conversations` reads each run's
chats back (tools and tool calls included) and `distill_examples` renders them with the student's
template, so the student learns the teacher's turns in its own format.

The forward is the GRPO step's: each example is one right-padded row (rows.py, micro-batches of at
most `micro_batch_size` rows and `micro_batch_tokens` positions, a shared prefix run once) and its
log-probs come from model.row_logprobs, the LM head in checkpointed chunks over the learned positions
only: never (B, C, V) logits (16 examples of 256 + 128 tokens on SmolLM2-135M: +11.4 GB before).

One `rlproxy sft` is one published step (one `training_steps` row, kind `sft`, num_runs 0: the runs
it learned from keep their status) however many optimizer steps it takes inside. It continues the
policy's newest checkpoint (adapter and AdamW moments) and numbers its step after the newest one.

Another process may train the same store meanwhile (`serve`'s trainer): both hold the store's steps
lock (service.STEPS_LOCK) from choosing a step number to committing it, so they never build the same
step, and `serve`'s trainer reloads the weights when it finds a step it did not make. A crash after
the checkpoint is saved leaves a step `serve` commits on its next poll (kind `sft`, from its state).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlproxy.errors import ConfigError, TrainerError
from rlproxy.inference.tools import messages_for_template
from rlproxy.storage.training import RunData
from rlproxy.trainer.batches import prompt_ids, usable
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import row_logprobs, trainable_parameters
from rlproxy.trainer.rows import Rows, micro_batches_by_tokens
from rlproxy.trainer.segments import Segment

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class SFTExample:
    """One sequence to learn: `context` is never a target; `target[i]` is learned where `mask[i]` is 1."""

    context: list[int]
    target: list[int]
    mask: list[float]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.mask))


# ---------------------------------------------------------------------------------------- examples


def read_chats(path: str | Path) -> list[dict[str, Any]]:
    """The chats of an OpenAI chat JSONL file (`{"messages": [...], "tools": [...]?}` per line).

    Raises ConfigError naming the line of the first malformed chat.
    """
    chats = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            chat = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not JSON: {exc.msg}") from None
        messages = chat.get("messages") if isinstance(chat, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f'{path}:{n}: expected {{"messages": [...]}} (OpenAI chat format)')
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise ConfigError(f"{path}:{n}: every message needs a role in {CHAT_ROLES}, got {m!r:.80}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{path}:{n}: no assistant message: nothing to learn")
        chats.append(chat)
    if not chats:
        raise ConfigError(f"{path}: no chats")
    return chats


def chat_example(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None = None
) -> SFTExample:
    """A chat rendered by the chat template, assistant turns learned (each through its end-of-turn token).

    The text is cut at the turn boundaries and each piece tokenized alone: the prompt before an
    assistant turn is tokenized exactly as the server tokenizes a generation prompt.
    """

    def render(msgs: list[dict[str, Any]], generation: bool) -> str:
        return tokenizer.apply_chat_template(
            msgs, tools=tools or None, add_generation_prompt=generation, tokenize=False
        )

    pieces: list[tuple[str, bool]] = []  # (text, learned)
    done = ""  # the text rendered so far
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not before.startswith(done) or not through.startswith(before):
            raise ConfigError("the chat template rewrites earlier turns: cannot mask its assistant turns")
        answer = through[len(before) :].rstrip("\n")  # the turn through its end-of-turn token
        pieces += [(before[len(done) :], False), (answer, True)]
        done = before + answer
    full = render(messages, False)
    pieces.append((full[len(done) :] if full.startswith(done) else "", False))

    ids: list[int] = []
    mask: list[float] = []
    for text, learned in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids += piece
        mask += [float(learned)] * len(piece)
    first = mask.index(1.0) if 1.0 in mask else len(ids)
    first = max(first, 1)  # the first token has no logits predicting it: it is always context
    return SFTExample(context=ids[:first], target=ids[first:], mask=mask[first:])


def run_examples(runs: list[RunData]) -> list[SFTExample]:
    """Every stored choice of every usable completion of `runs`, as exact tokens: prompt as context,
    sampled tokens learned. Completions stored without token ids are left out (logged)."""
    out: list[SFTExample] = []
    missing = 0
    for run in runs:
        for comp in run.completions:
            if not usable(comp):
                continue
            for choice, tokens in enumerate(comp.token_ids or []):
                prompt = prompt_ids(comp, choice)
                if not tokens or not prompt:
                    missing += 1
                    continue
                out.append(SFTExample(context=list(prompt), target=list(tokens), mask=[1.0] * len(tokens)))
            if not comp.token_ids:
                missing += 1
    if missing:
        log.warning(
            "%d stored completion(s) without token ids left out (SFT trains on exact tokens)", missing
        )
    return out


# The message keys a chat template reads; the rest of a provider's message (refusal, annotations,
# audio, reasoning) is not the student's to learn.
_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def _message(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: m[k] for k in _MESSAGE_KEYS if m.get(k) is not None}
    out.setdefault("content", "" if not out.get("tool_calls") else None)
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": c.get("type") or "function",
                "function": dict(c.get("function") or {}),
            }
            for c in out["tool_calls"]
        ]
    return out


def conversations(run: RunData) -> list[tuple[list[dict[str, Any]], list[Any] | None]]:
    """A run's conversations as (messages, tools): each answered chat call's request messages plus
    its reply; a conversation that a later call continues is left out (it is inside the later one)."""
    convs: list[tuple[list[dict[str, Any]], list[Any] | None]] = []
    for comp in run.completions:
        request, response = comp.request or {}, comp.response or {}
        choices = response.get("choices") or []
        messages = request.get("messages")
        if comp.status not in (None, "ok") or not isinstance(messages, list) or not choices:
            continue
        reply = choices[0].get("message") if isinstance(choices[0], dict) else None
        if not isinstance(reply, dict) or not (reply.get("content") or reply.get("tool_calls")):
            continue
        conv = [_message(m) for m in messages if isinstance(m, dict)] + [_message(reply)]
        convs = [(c, t) for c, t in convs if c != conv[: len(c)]]  # continued by this one
        convs.append((conv, request.get("tools")))
    return convs


def distill_examples(tokenizer: Any, runs: list[RunData]) -> tuple[list[SFTExample], int]:
    """The teacher's conversations of `runs` rendered with the student's chat template (`tokenizer`),
    tools and tool calls included, every assistant turn learned and nothing else: (examples, number
    of conversations the template could not mask, left out)."""
    out, refused = [], 0
    for run in runs:
        for messages, tools in conversations(run):
            try:
                out.append(chat_example(tokenizer, messages_for_template(messages), tools))
            except ConfigError as exc:
                refused += 1
                log.debug("run %s: conversation left out: %s", run.run_id, exc)
    if refused:
        log.warning("%d conversation(s) left out: the chat template rewrites earlier turns", refused)
    return out, refused


def truncate(example: SFTExample, max_seq_len: int) -> SFTExample | None:
    """`example` cut to `max_seq_len` tokens at its end; None when its context alone fills them."""
    keep = max_seq_len - len(example.context)
    if keep <= 0:
        return None
    return SFTExample(example.context, example.target[:keep], example.mask[:keep])


def sft_batches(
    examples: list[SFTExample], size: int, pad_id: int, max_tokens: int | None = None
) -> list[Rows]:
    """Examples as the GRPO step's rows (rows.py): context + target in one right-padded row, the
    learned tokens trained with their mask as weight; micro-batches of at most `size` rows and
    `max_tokens` padded positions (None: rows only), a shared prefix run once."""
    segments = [_segment(e) for e in examples]
    return micro_batches_by_tokens(segments, pad_id, max_rows=size, max_tokens=max_tokens)


def _segment(e: SFTExample) -> Segment:
    n, c = len(e.context) + len(e.target), len(e.context)
    return Segment(
        "",
        0.0,
        ids=e.context + e.target,
        trained=[False] * c + [m > 0 for m in e.mask],
        old_logprobs=[math.nan] * n,
        temperature=[1.0] * n,
        policy_step=[0] * n,
        call=[-1] * n,
        weight=[0.0] * c + list(e.mask),
    )


# ---------------------------------------------------------------------------------------- the math


def sft_loss(logp: Tensor, loss_mask: Tensor, total_tokens: int) -> tuple[Tensor, dict[str, float]]:
    """Cross-entropy of the learned tokens: sum of -log p over the mask / `total_tokens` (the optimizer
    step's learned tokens, so micro-batch losses add up to the step's token mean). logp and loss_mask:
    the same shape ((N,) of a micro-batch's trained tokens in sft_step)."""
    nll = -(logp * loss_mask).sum()
    n = loss_mask.sum().clamp(min=1)
    return nll / max(total_tokens, 1), {"loss/nll": (nll / n).item()}


def sft_micro_loss(model: Any, rows: Rows, total_tokens: int) -> tuple[Tensor, float]:
    """(loss, tokens predicted right) of one micro-batch: its share of the step's token-mean NLL, from
    the GRPO step's chunked LM head (model.row_logprobs: never (B, C, V) logits)."""
    logp, _, _, top = row_logprobs(model, rows)  # (N,)
    mask = rows.weight.to(logp.device, logp.dtype)  # (N,) each learned token's mask value
    loss, _ = sft_loss(logp, mask, total_tokens)
    return loss, float((top.to(mask.dtype) * mask).sum().item())


def sft_step(
    model: Any, optimizer: torch.optim.Optimizer, batches: list[Rows], config: TrainerConfig
) -> dict[str, float]:
    """One optimizer step of cross-entropy over `batches` (one step's examples); its metrics."""
    model.train()
    total = int(sum(b.weight.sum().item() for b in batches))

    # 1. forward/backward with accumulation: each micro-batch's summed NLL over the step's learned
    #    tokens, so the summed gradient is the gradient of the step's token-mean cross-entropy
    optimizer.zero_grad(set_to_none=True)
    loss_total, correct = 0.0, 0.0
    for b in batches:
        if not b.num_tokens:
            continue
        loss, right = sft_micro_loss(model, b, total)
        loss.backward()
        loss_total += loss.item()
        correct += right

    # 2. clip: the same global grad-norm bound as a GRPO step
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable_parameters(model), config.max_grad_norm))

    # 3. optimizer step, only on a finite loss and gradient
    skipped = not (math.isfinite(loss_total) and math.isfinite(grad_norm))
    if skipped:
        log.warning("SFT step skipped: loss %s, grad norm %s not finite", loss_total, grad_norm)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    # 4. log
    return {
        "loss/total": loss_total,
        "loss/grad_norm": grad_norm,
        "sft/token_accuracy": correct / max(total, 1),
        "sft/tokens": float(total),
        "step/skipped_nonfinite": float(skipped),
    }


@dataclass
class SFTResult:
    """What `train_sft` did: the numbers of its `training_steps` row and its metrics."""

    num_examples: int
    num_tokens: int  # learned tokens per epoch
    loss: float  # token-mean cross-entropy of the last epoch
    metrics: dict[str, float]


def train_sft(
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    examples: list[SFTExample],
    config: TrainerConfig,
    *,
    epochs: int = 1,
    batch_size: int = 16,
    seed: int = 0,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
) -> SFTResult:
    """`epochs` passes over `examples`, one optimizer step per `batch_size` examples (synchronous torch).
    `on_step(done, total, metrics)` after each optimizer step (the command's progress line)."""
    started = time.perf_counter()
    kept = [t for e in examples if (t := truncate(e, config.max_seq_len)) is not None and t.num_tokens > 0]
    if not kept:
        raise TrainerError(f"none of {len(examples)} examples has a token to learn within max_seq_len")
    order = random.Random(seed)
    total_steps = epochs * math.ceil(len(kept) / batch_size)
    steps, last = 0, list[dict[str, float]]()
    for epoch in range(epochs):
        shuffled = order.sample(kept, len(kept))
        last = []
        for i in range(0, len(shuffled), batch_size):
            step_examples = shuffled[i : i + batch_size]
            batches = sft_batches(
                step_examples, config.micro_batch_size, tokenizer.pad_token_id, config.micro_batch_tokens
            )
            last.append(sft_step(model, optimizer, batches, config))
            steps += 1
            if on_step is not None:
                on_step(steps, total_steps, last[-1])
        log.debug("SFT epoch %d: loss %.4f", epoch + 1, sum(m["loss/total"] for m in last) / len(last))
    tokens = sum(e.num_tokens for e in kept)
    weight = [m["sft/tokens"] / tokens for m in last]  # the last epoch's step metrics, token-weighted
    metrics = {k: sum(m[k] * w for m, w in zip(last, weight, strict=True)) for k in last[0]}
    seconds = time.perf_counter() - started
    metrics.update(
        {
            "sft/examples": float(len(kept)),
            "sft/epochs": float(epochs),
            "sft/optimizer_steps": float(steps),
            "sft/tokens": float(tokens),
            "step/skipped_nonfinite": float(sum(m["step/skipped_nonfinite"] for m in last)),
            "perf/seconds": seconds,
            "perf/tokens_per_s": epochs
            * sum(len(e.context) + len(e.target) for e in kept)
            / max(seconds, 1e-9),
        }
    )
    return SFTResult(len(kept), tokens, metrics["loss/total"], metrics)
