"""The directory task (a tool-using agent): its tool and reward, what SmolLM2 sees, what the trainer
trains on, and that its multi-call episodes train (the real `rlproxy serve`, the real agent)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from stub_upstream import StubUpstream

from rlproxy.demo import directory as task
from rlproxy.demo.harness import start_server, stop_server, wait_policy_step, wait_trained

# ------------------------------------------------------------------ the tool and the reward


def test_lookup_is_plain_python() -> None:
    assert task.lookup('{"name": "Alice"}') == ({"name": "Alice", "extension": "4821"}, "Alice")
    assert task.lookup({"name": " frank "})[1] == "Frank"
    assert task.lookup('{"name": "Zed"}')[1] is None and "error" in task.lookup('{"name": "Zed"}')[0]
    assert task.lookup("not json")[1] is None
    assert task.lookup('{"who": "Alice"}')[1] is None


@pytest.mark.parametrize(
    ("answer", "looked_up", "attempted", "reward"),
    [
        ("Alice: 4821, Frank: 3307", {"Alice", "Frank"}, True, 1.0),
        ("4821 and 3307", set(), False, 0.7),  # the answer dominates (no model guesses these)
        ("Alice: 4821", {"Alice"}, True, 0.55),
        ("I don't know", {"Alice", "Frank"}, True, 0.3),  # well-formed lookups: partial credit
        ("I don't know", {"Alice"}, False, 0.2),  # a valid lookup is an attempt
        ("48213307", set(), True, 0.1),  # digits must be the extensions themselves; a try counts
        (None, set(), False, 0.0),
    ],
)
def test_score(answer: str | None, looked_up: set[str], attempted: bool, reward: float) -> None:
    value, metrics = task.score(("Alice", "Frank"), answer, looked_up, attempted)
    assert value == pytest.approx(reward)
    assert set(metrics) == {"extensions_found", "people_looked_up", "tried_a_call"}


def test_smollm2_sees_the_tools_and_their_results(cache_dir: Path) -> None:
    """SmolLM2's own template ignores `tools`; the prepared model's renders the schema, the format,
    a tool-call turn (content null) and the tool's result."""
    from transformers import AutoTokenizer

    from rlproxy.inference.models import resolve_model
    from rlproxy.inference.tools import messages_for_template

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m", cache_dir=cache_dir))
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"name": "Alice"}'}}
    messages = [
        {"role": "system", "content": task.SYSTEM},
        {"role": "user", "content": task.QUESTION.format(a="Alice", b="Frank")},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"name": "Alice", "extension": "4821"}'},
    ]
    text = tok.apply_chat_template(
        messages_for_template(messages), tools=task.TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert json.dumps(task.TOOLS[0]) in text and "<tool_call>" in text
    assert '<tool_call>\n{"name": "lookup", "arguments": {"name": "Alice"}}\n</tool_call>' in text
    assert '<tool_response>\n{"name": "Alice", "extension": "4821"}\n</tool_response>' in text
    assert text.startswith("<|im_start|>system\n" + task.SYSTEM) and text.endswith("<|im_start|>assistant\n")
    # without tools: exactly SmolLM2-Instruct's own rendering
    plain = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert plain == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
    )


# ------------------------------------------------------------------ through the real server


def _server(tmp_path: Path, cache_dir: Path, model: str, env: dict[str, str]) -> tuple[Any, str]:
    env = {
        "RLPROXY_CACHE_DIR": str(cache_dir),
        "RLPROXY_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "RLPROXY_ENGINE_THREADS": "1",
        "RLPROXY_TRAIN_THREADS": "1",
        "RLPROXY_POLL_INTERVAL": "0.1",
        "RLPROXY_UNLOAD_GRACE": "0",
        **env,
    }
    return start_server(tmp_path, model, 0, 8, env)


def _run_detail(http: httpx.Client, run_id: str, calls: int) -> dict[str, Any]:
    """The run with its completions, once all `calls` are committed."""
    for _ in range(200):
        run = http.get(f"/v1/runs/{run_id}").json()
        if len(run.get("completions", [])) >= calls:
            return run
        time.sleep(0.05)
    raise TimeoutError(run_id)


class ScriptedModel(StubUpstream):
    """An upstream that answers like the embedded engine, with `tiny`'s tokenizer and chat template,
    but plays the task perfectly: a lookup for each person, then the answer. Its prompt ids are the
    rendered request (tools, tool results and all), its token ids the reply's: what the proxy stores
    of any engine. A scripted policy makes the trajectory deterministic, tool results included."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tok = tokenizer

    def _full(self, req: dict, chat: bool) -> dict:
        from rlproxy.inference.tools import messages_for_template, parse_tool_calls

        messages = req["messages"]
        text = self.tok.apply_chat_template(
            messages_for_template(messages),
            tools=req.get("tools"),
            add_generation_prompt=True,
            tokenize=False,
        )
        prompt = self.tok.encode(text, add_special_tokens=False)
        found = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
        people = ("Alice", "Frank")
        if len(found) < 2:
            call = json.dumps({"name": "lookup", "arguments": {"name": people[len(found)]}})
            reply = f"<tool_call>\n{call}\n</tool_call>"
        else:
            reply = ", ".join(f"{f['name']}: {f['extension']}" for f in found)
        ids = [*self.tok.encode(reply, add_special_tokens=False), self.tok.eos_token_id]
        content, calls = parse_tool_calls(reply)
        lp = {"content": [{"token": str(t), "logprob": -0.5, "bytes": None, "top_logprobs": []} for t in ids]}
        return {
            "id": "chatcmpl-scripted",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, "tool_calls": calls},
                    "logprobs": lp if req.get("logprobs") else None,
                    "finish_reason": "tool_calls" if calls else "stop",
                    "token_ids": ids if req.get("return_token_ids") else None,
                }
            ],
            "prompt_token_ids": prompt if req.get("return_token_ids") else None,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": 0},
        }


def test_trainer_trains_only_what_the_model_sampled(
    tmp_path: Path, cache_dir: Path, tiny_tokenizer: Any, loop_thread: Any
) -> None:
    """A directory episode through the real `rlproxy serve` (no trainer) in front of a scripted model:
    the batch the trainer builds from the stored rows has everything the model was given (system,
    tools, question, tool results) as prompt, and its loss mask covers exactly the sampled tokens."""
    from oracle import build_samples, collate

    from rlproxy.storage.db import create_engine
    from rlproxy.storage.training import load_runs

    upstream = ScriptedModel(tiny_tokenizer)
    loop_thread.run(upstream.start())
    proc, base = _server(
        tmp_path, cache_dir, "tiny", {"RLPROXY_TRAIN": "false", "RLPROXY_UPSTREAM": upstream.url}
    )
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        ep = task.play_episode(client, "stub-model", "g", ("Alice", "Frank"))  # the upstream's name
        assert (ep.reward, ep.calls) == (1.0, 3)
        with httpx.Client(base_url=base, timeout=30) as http:
            assert http.post(f"/v1/runs/{ep.run_id}/reward", json={"reward": ep.reward}).status_code == 200
            stored = _run_detail(http, ep.run_id, ep.calls)
    finally:
        stop_server(proc)
        loop_thread.run(upstream.stop())
    assert [c["request"]["messages"][-1]["role"] for c in stored["completions"]] == ["user", "tool", "tool"]

    db = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}")
    (run,) = asyncio.run(load_runs(db, [ep.run_id]))
    asyncio.run(db.dispose())
    samples, counts = build_samples([run], {run.run_id: 1.0}, tiny_tokenizer, 4096)
    assert counts.rebuilt == 0 and len(samples) == len(run.completions) == 3
    batch = collate(samples, tiny_tokenizer.pad_token_id)
    P = batch.input_ids.shape[1] - batch.completion_len
    for i, (sample, comp) in enumerate(zip(samples, run.completions, strict=True)):
        sampled = comp.token_ids[0]
        # the loss mask: 1 on exactly the sampled tokens, in the completion columns
        assert sample.completion_ids == sampled and sample.prompt_ids == comp.prompt_token_ids
        assert batch.mask[i].sum().item() == len(sampled)
        assert batch.completion_ids[i, : len(sampled)].tolist() == sampled
        # everything the model was given is in the prompt columns, which no loss covers
        prompt_text = tiny_tokenizer.decode(batch.input_ids[i, :P])
        for m in comp.request["messages"]:
            if m["role"] in ("system", "user"):
                assert m["content"] in prompt_text
            if m["role"] == "tool":  # the tool's output: context, never a trained token
                assert f"<tool_response>\n{m['content']}\n</tool_response>" in prompt_text
                assert m["content"] not in tiny_tokenizer.decode(sampled)
    assert int(batch.mask.sum().item()) == sum(len(c.token_ids[0]) for c in run.completions)


FAVORED_SEED = 0


def _favored(model_dir: str) -> set[int]:
    """Half of tiny's vocabulary, along one direction of its embeddings (see trainer/test_learning)."""
    from transformers import AutoModelForCausalLM

    emb = AutoModelForCausalLM.from_pretrained(model_dir).get_input_embeddings().weight.detach()
    u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(FAVORED_SEED))
    return set((emb @ u > 0).nonzero().flatten().tolist())


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_multi_call_episodes_learn_on_tiny(tmp_path: Path, cache_dir: Path) -> None:
    """The directory agent's episodes (several model calls each, reminders in between) through the real
    `rlproxy serve` with its trainer: every call of a run trains with the run's advantage. The random
    `tiny` model cannot call a tool, so the reward here is one it can learn: the share of its sampled
    tokens (all calls of the episode) in a fixed half of the vocabulary. Episodes run one at a time
    with fixed seeds, on one thread: deterministic on one machine, not across CPUs (float kernels
    differ, so sampled tokens diverge): trainer seed 0 alone passed CI at 6357d57 and gained +0.003 on
    another (an AMD EPYC), where seeds 1 and 2 gained more. Nor across equal gradients: at lr 0.05 a
    step's change in the 7th digit (27b67df's prefix tree, the same gradient within 7e-7) sends a seed
    elsewhere. On a 2-core Xeon, seeds 0-7 gained 0.014 0.278 0.039 0.462 0.295 0.387 0.158 0.271 at
    27b67df; seeds 0-2 gained 0.440 0.287 0.164 at the commit before it. A seed that does not learn
    stays near +0.0 (0 and 2 there). So six trainer seeds: their mean gain >= 0.15, and at least half
    of them gain > 0.1."""
    from rlproxy.inference.models import resolve_model

    favored = _favored(resolve_model("tiny", cache_dir=cache_dir))
    curves = [_learn_curve(tmp_path / f"seed{seed}", cache_dir, favored, seed) for seed in range(6)]
    gains = [sum(c[-3:]) / 3 - sum(c[:3]) / 3 for c in curves]
    shown = [(round(g, 3), [round(m, 3) for m in c]) for g, c in zip(gains, curves, strict=True)]
    assert sum(gains) / len(gains) >= 0.15, shown
    assert sum(g > 0.1 for g in gains) >= len(gains) // 2, shown


def _learn_curve(tmp_path: Path, cache_dir: Path, favored: set[int], seed: int) -> list[float]:
    """One trainer seed of the test above: each round's mean reward."""
    tmp_path.mkdir()
    rounds, n = 24, 8
    proc, base = _server(
        tmp_path, cache_dir, "tiny", {"RLPROXY_LEARNING_RATE": "0.05", "RLPROXY_SEED": str(seed)}
    )
    means: list[float] = []
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        with httpx.Client(base_url=base, timeout=30) as http:
            for rnd in range(rounds):
                group = f"g{rnd}"
                rewards = []
                for i in range(n):
                    ep = task.play_episode(
                        client, "tiny", group, ("Alice", "Frank"), 1.0, 8, seed=rnd * 100 + i
                    )
                    assert ep.calls >= 3  # reminders keep an episode going when no tool is called
                    run = _run_detail(http, ep.run_id, ep.calls)
                    tokens = [t for c in run["completions"] for t in (c["token_ids"] or [[]])[0]]
                    reward = sum(t in favored for t in tokens) / max(1, len(tokens))
                    rewards.append(reward)
                    http.post(f"/v1/runs/{ep.run_id}/reward", json={"reward": reward}).raise_for_status()
                means.append(sum(rewards) / n)
                runs = wait_trained(http, group, n, timeout=300)
                steps = [r["trained_step"] for r in runs if r["trained_step"]]
                if steps:
                    wait_policy_step(http, "tiny", max(steps))
    finally:
        stop_server(proc)
    return means
