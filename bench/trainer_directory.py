"""The `directory` shape for bench/trainer.py: one group of 8 multi-call tool-using episodes, token-exact.

Synthesized, not captured (no database is committed): the episodes of `rlproxy demo --task directory`
(rlproxy/demo/directory.py: its SYSTEM prompt, TOOLS, QUESTION and NUDGE, MAX_TOKENS 32) are rendered
with the served model's own chat template (SmolLM2 with the hermes tools template, as `serve` renders
them), the way the embedded engine stores a call: `prompt_token_ids` = the template's rendering of
the request's messages with the generation prompt; `token_ids` = the reply's tokens up to and
including the end-of-turn token the engine sampled. The next call's prompt is rendered again from
the messages (the agent appends the parsed tool call and the tool's result), so whether it extends
the previous prompt + sampled ids token-exactly is up to the template, as in a real capture. The
episodes mix well-formed lookups, a malformed reply with a reminder, and plain answers: 3 to 5 calls,
32 in all. Two tool calls are rendered with their JSON spaced the way the server re-serializes it
(`{"name":"lookup",...}` sampled, `{"name": "lookup", ...}` rendered), as in the captured group,
where 22 of its 24 transitions extended and 2 broke.
"""

from __future__ import annotations

import json
import random
from typing import Any

# per episode: the reply kinds of its calls, in order (32 calls in all)
PLANS: list[list[str]] = [
    ["call", "call", "answer"],
    ["text", "call", "call", "answer"],
    ["call", "text", "call", "answer"],
    ["call", "call_tight", "answer", "answer"],
    ["text", "call", "text", "call", "answer"],
    ["call", "call", "answer", "answer"],
    ["call_tight", "call", "text", "answer"],
    ["text", "call", "call", "answer"],
]
PEOPLE = ("Alice", "Frank")


def _reply(kind: str, name: str, rng: random.Random) -> tuple[str, dict[str, Any] | None]:
    """(text the model sampled, the tool call the server parsed from it or None)."""
    if kind in ("call", "call_tight"):
        args = {"name": name}
        if kind == "call_tight":  # sampled without spaces; the template renders json.dumps' spacing
            raw = json.dumps({"name": "lookup", "arguments": args}, separators=(",", ":"))
        else:
            raw = json.dumps({"name": "lookup", "arguments": args})
        return f"<tool_call>\n{raw}\n</tool_call>", {"name": "lookup", "arguments": json.dumps(args)}
    if kind == "text":
        words = ["I", "will", "look", "it", "up", "for", "you", "now", "the", "directory", "says"]
        return " ".join(rng.choice(words) for _ in range(rng.randint(12, 24))), None
    return f"{PEOPLE[0]}: 4821, {PEOPLE[1]}: 3307", None


def episodes(tokenizer: Any, seed: int = 0) -> list[list[tuple[list[int], list[int]]]]:
    """8 episodes, each a list of calls (prompt_token_ids, sampled token_ids)."""
    from rlproxy.demo.directory import NUDGE, QUESTION, SYSTEM, TOOLS

    rng = random.Random(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for plan in PLANS:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION.format(a=PEOPLE[0], b=PEOPLE[1])},
        ]
        calls, todo = [], list(PEOPLE)
        for i, kind in enumerate(plan):
            prompt = tokenizer.apply_chat_template(
                messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
            )
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            name = todo[0] if todo else PEOPLE[0]
            text, call = _reply(kind, name, rng)
            sampled = tokenizer(text, add_special_tokens=False)["input_ids"][:31] + [end]  # max_tokens 32
            calls.append((prompt_ids, sampled))
            if call is not None:
                tid = f"call_{i}"
                tc = {"id": tid, "type": "function", "function": call}
                messages.append({"role": "assistant", "content": "", "tool_calls": [tc]})
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": tid,
                        "content": json.dumps({"name": name, "extension": "4821"}),
                    }
                )
                todo = todo[1:]
            else:
                messages.append({"role": "assistant", "content": text})
                messages.append({"role": "user", "content": NUDGE.format(name=name)})
        out.append(calls)
    return out


REWARDS = [1.0, 0.45, 0.8, 0.2, 0.1, 1.0, 0.55, 0.3]


def worker(model_dir: str, steps: int, path: str, micro_batch_tokens: int | None) -> dict:
    """Time train_step on the directory group: `path` old (per_call, no merge, micro_batch_size 8, fp32),
    new (the defaults: merged, run weighting, fp32), new-bf16 (train_autocast bf16) or merged-per-call."""
    import time

    import torch

    from rlproxy.storage.training import CompletionData, RunData
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy, row_logprobs
    from rlproxy.trainer.rows import collate_rows
    from rlproxy.trainer.segments import build_segments
    from rlproxy.trainer.step import make_optimizer, train_step

    new = path in ("new", "new-bf16")
    # fp32 but for new-bf16 (train_autocast bf16, opt-in): the old path as the code before merging ran
    precision = {"train_autocast": "bf16" if path == "new-bf16" else "off"}
    if "train_autocast" not in TrainerConfig.model_fields:  # --old-tree: code from before the setting
        precision = {}
    cfg = TrainerConfig(
        learning_rate=1e-5,
        micro_batch_size=8,
        loss="grpo",
        merge_calls=path != "old",
        loss_weighting="run" if new else "per_call",  # merged per_call: the old gradient, merged
        micro_batch_tokens=micro_batch_tokens,
        max_grad_norm=1e9,  # the norm is read before the clip; nothing is cut, so both sides compare
        **precision,
    )
    model, tok = load_policy(model_dir, cfg)
    opt = make_optimizer(model, cfg)
    eps = episodes(tok)
    runs = []
    for i, calls in enumerate(eps):
        comps = []
        for seq, (prompt, sampled) in enumerate(calls):
            probe = RunData(
                "x", "g", "p", 0.0, [CompletionData("x", 0, 0, None, None, None, prompt, [sampled], None)]
            )
            segs, _ = build_segments([probe], {"x": 0.0}, tok, 4096)
            with torch.no_grad():  # the sampling logprobs the serving engine would have stored (not timed)
                lp = row_logprobs(model, collate_rows(segs, tok.pad_token_id))[0].tolist()
            req = {"temperature": 0.7, "max_tokens": 32}
            comps.append(
                CompletionData(f"r{i}", seq, 0, "chat.completions", req, None, prompt, [sampled], [lp])
            )
        runs.append(RunData(f"r{i}", "g", "p", REWARDS[i], comps))
    times, cpu, metrics = [], [], {}
    warm = steps > 1  # with more than one step the first warms up; with one, that one is timed
    for i in range(steps + 1 if warm else 1):
        t0, c0 = time.perf_counter(), time.process_time()
        metrics = train_step(model, tok, opt, runs, cfg).metrics
        if i == 0:
            first = metrics
        if i > 0 or not warm:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    keys = ("merge/positions_merged", "merge/positions_unmerged", "merge/breaks", "merge/segments")
    return {
        "times": times,
        "cpu": cpu,
        "calls": sum(len(c) for c in eps),
        "prompt_tokens": sum(len(p) for c in eps for p, _ in c),
        "positions": first.get("perf/input_tokens"),
        "grad_norm": first.get("loss/grad_norm"),
        "micro_batches": first.get("perf/micro_batches"),
        **{k: first.get(k) for k in keys},
    }
