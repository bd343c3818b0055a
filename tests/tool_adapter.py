"""A LoRA adapter that teaches the random `tiny` model to call a tool, for tests of agent loops.

The tiny model is random: it never writes a `<tool_call>` by itself, and forcing one with
`tool_choice="required"` does not help either (vLLM 0.32's guided decoding lets a random model fill
the arguments with whitespace until `max_tokens`). So the tests that need an agent to call a tool use
this adapter: a few hundred supervised steps (a minute on a CPU, cached) teach it, at temperature 0,
- a prompt that offers `get_time` and ends with a user turn -> `<tool_call>{"name": "get_time", ...}`,
- a prompt that ends with the tool's answer -> `ANSWER`,
on prompts varied enough (system text, user text, tool schema details) that the exact prompt an SDK
builds is answered the same way. Training uses the trainer's own model and optimizer, and the adapter
is saved as the trainer's checkpoint `{root}/{policy}/step-0001/`: a `serve` started with that
checkpoint folder publishes it as step 1 of the policy (the trainer's restart recovery) and resumes
GRPO from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CACHE_NAME = "tool-adapter-v2"  # the cache folder: a new name whenever the recipe below changes
TOOL_NAME = "get_time"
TOOL_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
ANSWER = "It is noon."

# `get_time` as a Responses-API function tool, exactly as the Agents SDK sends a no-argument tool
RESPONSES_TOOL = {
    "type": "function",
    "name": TOOL_NAME,
    "description": "Current time.",
    "parameters": {
        "properties": {},
        "title": "get_time_args",
        "type": "object",
        "additionalProperties": False,
        "required": [],
    },
    "strict": True,
}
INSTRUCTIONS, QUESTION = "You tell the time.", "What time is it?"  # what the adapter was taught on

_SYSTEMS = [None, INSTRUCTIONS]
_USERS = [QUESTION, "Tell me the time."]
_RESULTS = ["12:00", "noon"]


def _tools(variant: int) -> list[dict[str, Any]]:
    """`get_time` as chat tools: as the Agents SDK's strict schema comes out of the Responses
    translation (odd variants), or plain."""
    if variant % 2:
        fn = {k: v for k, v in RESPONSES_TOOL.items() if k != "type"}
    else:
        fn = {"name": TOOL_NAME, "description": "Return the time.", "parameters": {"type": "object"}}
    return [{"type": "function", "function": fn}]


def _examples(tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) pairs: the tool call after a user turn, ANSWER after the tool's result."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    k = 0
    for system in _SYSTEMS:
        for user in _USERS:
            k += 1
            head = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": user}
            ]
            call = {"id": f"call_{k}", "type": "function", "function": {"name": TOOL_NAME, "arguments": "{}"}}
            turns = [
                (head, TOOL_CALL),
                (
                    [
                        *head,
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": f"call_{k}", "content": _RESULTS[k % len(_RESULTS)]},
                    ],
                    ANSWER,
                ),
            ]
            for messages, target in turns:
                text = tokenizer.apply_chat_template(
                    messages, tools=_tools(k), add_generation_prompt=True, tokenize=False
                )
                prompt = tokenizer.encode(text, add_special_tokens=False)
                out.append((prompt, tokenizer.encode(target, add_special_tokens=False) + [eos]))
    return out


def make_tool_checkpoint(model_dir: Path, root: Path, policy: str, steps: int = 200) -> Path:
    """Train the adapter and save it as checkpoint 1 of `policy` under `root`; returns its folder."""
    import torch

    from rlproxy.trainer.checkpoint import save_checkpoint, step_dir
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy
    from rlproxy.trainer.step import make_optimizer

    final = step_dir(root, policy, 1)
    if final.is_dir():
        return final
    config = TrainerConfig(learning_rate=2e-2, checkpoint_dir=str(root))
    model, tokenizer = load_policy(str(model_dir), config)
    optimizer = make_optimizer(model, config)
    examples = _examples(tokenizer)
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.full((len(examples), width), tokenizer.pad_token_id)  # (B, T), right padded
    labels = torch.full((len(examples), width), -100)  # loss only on the targets
    for i, (p, t) in enumerate(examples):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    mask = (labels != -100) | (torch.arange(width) < torch.tensor([len(p) for p, _ in examples])[:, None])
    # the learning rate decays linearly to 0: at a constant 2e-2 AdamW stalls around loss 0.01, and
    # higher rates diverge
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1 - i / steps)
    loss = None
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if loss.item() < 0.01:
            # each token ~0.99 likely: as far as a LoRA gets here (after the final RMSNorm the tiny
            # model's tied logits cannot stand further out of its 1,227 tokens); greedy, or top_p
            # below 0.95, then always picks the taught tokens
            break
    state = {"run_ids": [], "loss": loss.item() if loss is not None else 0.0, "metrics": {}, "kind": "sft"}
    saved = save_checkpoint(root, policy, 1, model, optimizer, state)
    (saved.path / "tool_adapter.json").write_text(json.dumps({"tool": TOOL_NAME, "answer": ANSWER}))
    return saved.path
