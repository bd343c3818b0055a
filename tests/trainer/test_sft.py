"""SFT from a chat file and from the store, while `serve` serves: the next requests get the SFT'd adapter.

16 chats (or 16 stored runs) whose answers the tiny model's greedy decoding did not give before give
them after one `rlproxy sft` (`X-Policy-Step` moves from 0 to 1). The file case runs the command in
another process next to a `serve` whose trainer is on (they share the store's steps lock); the store
case learns the exact tokens the proxy captured. A trainer that finds a step it did not make (an SFT
step) continues from its weights, and waits while another process holds the steps lock.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI
from oracle import Sample, collate, completion_logits
from safetensors.torch import load_file
from serving import serving
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from support import ServerlessBackend, rows, tiny_settings

from rlproxy.cli import processes
from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.settings import Settings
from rlproxy.storage.leader import LeaderLock
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.losses import sampled_logprobs
from rlproxy.trainer.model import load_policy
from rlproxy.trainer.offline import run_sft
from rlproxy.trainer.service import STEPS_LOCK, TrainerService
from rlproxy.trainer.sft import SFTExample, chat_example, read_chats, sft_batches, sft_loss, sft_micro_loss

RLPROXY = str(Path(sys.executable).parent / "rlproxy")
WORDS = (
    "apple river stone cloud tiger lemon piano rocket silver garden window candle forest bridge castle planet"
)
CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"Say word {i}."},
            {"role": "assistant", "content": f"{w} {i}"},
        ]
    }
    for i, w in enumerate(WORDS.split())
]
SFT_LR = 1e-2  # the tiny random model memorizes 16 short answers in ~40 epochs at this rate (~10 s, 1 thread)


async def answers(
    client: AsyncOpenAI, model: str, prompts: list[list[dict]], max_tokens: int
) -> list[tuple[str, str]]:
    """(X-Policy-Step, greedy text) per prompt."""
    out = []
    for messages in prompts:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        out.append((raw.headers["x-policy-step"], raw.parse().choices[0].message.content or ""))
    return out


async def wait_for_step(client: AsyncOpenAI, model: str, step: str) -> None:
    for _ in range(300):
        got = await answers(client, model, [CHATS[0]["messages"][:1]], 2)
        if got[0][0] == step:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{model} never served at step {step}")


def settings_for(tiny_model_dir: Path, tmp_path: Path, **fields: Any) -> Settings:
    return tiny_settings(tiny_model_dir, tmp_path, policy_poll_interval=0.1, poll_interval=0.1, **fields)


# ------------------------------------------------------------------------------------------ examples


def test_chat_example_learns_assistant_turns_only(tiny_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you"},
    ]
    ex = chat_example(tiny_tokenizer, messages)
    learned = [t for t, m in zip(ex.target, ex.mask, strict=True) if m]
    assert tiny_tokenizer.decode(learned) == "Hello there<|im_end|>See you<|im_end|>"
    # the whole conversation, in order: context + target is the template's text
    full = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert tiny_tokenizer.decode(ex.context + ex.target) == full
    # the context of the first answer is the generation prompt, tokenized as the server does
    prompt = tiny_tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert ex.context == tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_chat_file_errors_name_the_line(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text(
        json.dumps(CHATS[0]) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n"
    )
    with pytest.raises(Exception, match=r"c.jsonl:2: no assistant message"):
        read_chats(f)
    f.write_text("{not json\n")
    with pytest.raises(Exception, match=r"c.jsonl:1: not JSON"):
        read_chats(f)


def test_sft_loss_is_the_token_mean_nll() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.125, 1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, m = sft_loss(logp, mask, total_tokens=3)
    nll = -(torch.log(torch.tensor(0.5)) + torch.log(torch.tensor(0.25)) + torch.log(torch.tensor(0.125)))
    assert loss.item() == pytest.approx(nll.item() / 3)
    assert m["loss/nll"] == pytest.approx(nll.item() / 3)
    loss, _ = sft_loss(logp, mask, total_tokens=6)  # one micro-batch of a step holding 6 learned tokens
    assert loss.item() == pytest.approx(nll.item() / 6)


def _old_sft_loss(model: Any, examples: list[SFTExample], size: int, pad_id: int) -> tuple[float, float]:
    """The SFT loss and token accuracy as sft_step computed them before it used row_logprobs: left-padded
    context + right-padded target, full (B, C, V) logits (completion_logits). The oracle; backward runs."""
    total = sum(e.num_tokens for e in examples)
    loss_sum, correct = 0.0, 0.0
    for i in range(0, len(examples), size):
        chunk = examples[i : i + size]
        samples = [Sample("", 0.0, e.context, e.target, [0.0] * len(e.target)) for e in chunk]
        batch = collate(samples, pad_id)
        mask = torch.zeros_like(batch.mask)
        for row, e in enumerate(chunk):
            mask[row, : len(e.mask)] = torch.tensor(e.mask)
        logits = completion_logits(model, batch)  # (B, C, V)
        logp = sampled_logprobs(logits, batch.completion_ids)
        correct += ((logits.detach().argmax(-1) == batch.completion_ids).float() * mask).sum().item()
        loss, _ = sft_loss(logp, mask, total)
        loss.backward()
        loss_sum += loss.item()
    return loss_sum, correct


def test_sft_loss_from_chunked_head_equals_full_logits(tiny_model_dir: Path, tiny_tokenizer: Any) -> None:
    """sft_step's loss, gradient and accuracy from the GRPO step's chunked head (row_logprobs) are the
    ones the full (B, C, V) logits gave (<= 1e-6), with a shared prefix, masked turns and a token budget
    that splits the step into several micro-batches."""
    model, tok = load_policy(str(tiny_model_dir), TrainerConfig(seed=0))
    with torch.no_grad():  # a non-zero adapter
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    lora = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    examples = [chat_example(tiny_tokenizer, c["messages"]) for c in CHATS[:5]]
    multi = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you"},
    ]
    examples.append(chat_example(tiny_tokenizer, multi))  # context turns inside the target: mask 0
    for n in (3, 9, 17):  # stored-run shape: random prompt, every sampled token learned
        ctx = torch.randint(10, 250, (n,), generator=g).tolist()
        tgt = torch.randint(10, 250, (n // 2 + 2,), generator=g).tolist()
        examples.append(SFTExample(ctx, tgt, [1.0] * len(tgt)))
    assert any(0.0 in e.mask for e in examples)
    old_loss, old_correct = _old_sft_loss(model, examples, 4, tok.pad_token_id)
    old_grads = [p.grad.clone() for p in lora]
    for p in lora:
        p.grad = None

    batches = sft_batches(examples, 4, tok.pad_token_id, max_tokens=150)
    assert len(batches) > 3 and any(b.shared for b in batches)
    total = int(sum(b.weight.sum().item() for b in batches))
    assert total == sum(e.num_tokens for e in examples)
    new_loss, new_correct = 0.0, 0.0
    for b in batches:
        loss, right = sft_micro_loss(model, b, total)
        loss.backward()
        new_loss, new_correct = new_loss + loss.item(), new_correct + right
    assert abs(new_loss - old_loss) <= 1e-6, (new_loss, old_loss)
    assert new_correct == old_correct
    for new, old in zip((p.grad for p in lora), old_grads, strict=True):
        assert torch.allclose(new, old, atol=1e-6, rtol=0), (new - old).abs().max()


# ------------------------------------------------------------------------------- through the proxy


async def test_sft_from_a_file_while_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = settings_for(tiny_model_dir, tmp_path, train=True)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    prompts = [c["messages"][:1] for c in CHATS]
    wanted = [c["messages"][1]["content"] for c in CHATS]
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    async with serving(settings, backend) as base:
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        policy = backend.served_model
        before = await answers(client, policy, prompts, 8)
        assert {s for s, _ in before} == {"0"}
        assert not any(text == w for (_, text), w in zip(before, wanted, strict=True))

        env = {
            **os.environ,
            "RLPROXY_DB_URL": settings.db_url,
            "RLPROXY_CHECKPOINT_DIR": settings.checkpoint_dir,
            "RLPROXY_TRAIN_THREADS": "1",
        }
        args = [
            "sft",
            "--policy",
            policy,
            "--file",
            str(chats),
            "--epochs",
            "40",
            "--learning-rate",
            str(SFT_LR),
            "--publish",  # onto the served policy itself (else `--into NEW`: a fork)
        ]
        proc = await asyncio.create_subprocess_exec(
            RLPROXY, *args, "--model", str(tiny_model_dir), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 300)
        assert proc.returncode == 0, err.decode()
        assert f"step 1 of {policy} (sft)" in out.decode()

        await wait_for_step(client, policy, "1")  # the proxy's poll loads the SFT step and serves it
        after = await answers(client, policy, prompts, 8)
        assert after == [("1", w) for w in wanted]
        steps = (await httpx.AsyncClient(base_url=base).get("/v1/training/steps")).json()
    db = tmp_path / "rlproxy.db"
    ((kind, num_runs, source, examples),) = rows(
        db,
        "SELECT kind, num_runs, json_extract(config, '$.sft_file'), "
        "json_extract(metrics, '$.\"sft/examples\"') FROM training_steps",
    )
    assert (kind, num_runs, source, examples) == ("sft", 0, str(chats), 16)
    assert steps


async def test_sft_from_the_store_learns_the_captured_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = settings_for(tiny_model_dir, tmp_path, train=False)
    prompts = [[{"role": "user", "content": f"Task {i}: write something."}] for i in range(20)]
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    async with serving(settings, backend) as base:
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        policy = backend.served_model
        sampled = []
        async with httpx.AsyncClient(base_url=base) as http:
            for i, messages in enumerate(prompts):  # 16 good runs, 4 bad ones the --where leaves out
                reply = await client.chat.completions.create(
                    model=policy, messages=messages, max_tokens=6, temperature=1.0, seed=i,
                    extra_headers={"X-Run-Id": f"r{i}"},
                )  # fmt: skip
                sampled.append(reply.choices[0].message.content or "")
                resp = await http.post(f"/v1/runs/r{i}/reward", json={"reward": 1.0 if i < 16 else 0.0})
                assert resp.status_code == 200, resp.text
        good = prompts[:16]
        before = await answers(client, policy, good, 6)
        assert not any(text == s for (_, text), s in zip(before, sampled[:16], strict=True))

        sft_settings = settings.model_copy(update={"learning_rate": SFT_LR})
        out = await processes.run_sft(sft_settings, policy, where="reward >= 0.9", epochs=40)
        assert (out["step"], out["sft/examples"]) == (1, 16.0)

        await wait_for_step(client, policy, "1")
        after = await answers(client, policy, good, 6)
        assert after == [("1", s) for s in sampled[:16]]
    db = tmp_path / "rlproxy.db"
    assert rows(db, "SELECT kind, json_extract(config, '$.sft_where') FROM training_steps") == [
        ("sft", "reward >= 0.9")
    ]
    # the runs it learned from keep their status (SFT trains no run)
    assert rows(db, "SELECT DISTINCT status FROM runs") == [("completed",)]


# ------------------------------------------------------------------- next to the trainer of serve


def completions(rng: random.Random) -> list[dict[str, Any]]:
    prompt = [rng.randrange(3, 1200) for _ in range(6)]
    return [{"prompt_token_ids": prompt, "token_ids": [[rng.randrange(3, 1200) for _ in range(4)]]}]


async def add_group(engine: AsyncEngine, add_run: Any, gid: str, seed: int) -> None:
    rng = random.Random(seed)
    for i, r in enumerate([1.0, 0.0, 0.5, 0.25]):
        await add_run(engine, f"{gid}-{i}", group_id=gid, reward=r, completions=completions(rng))


def lora_weights(ck: Path, step: int) -> torch.Tensor:
    w = load_file(str(ck / "tiny" / f"step-{step:04d}" / "adapter_model.safetensors"))
    return torch.cat([w[k].flatten() for k in sorted(w)])


async def test_trainer_waits_for_and_continues_an_sft_step(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    ck = tmp_path / "ck"
    config = TrainerConfig(group_size=4, learning_rate=1e-3, checkpoint_dir=str(ck), poll_interval=0.05)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    svc = TrainerService(config, db_url, ServerlessBackend(tiny_model_dir))
    try:
        await add_group(engine, add_run, "A", seed=1)
        assert (await svc.step_once())["step"] == 1  # type: ignore[index]

        # another process holds the steps lock (an `rlproxy sft` building its step): the trainer waits
        await add_group(engine, add_run, "B", seed=2)
        other = LeaderLock(db_url, STEPS_LOCK)
        assert await other.try_acquire()
        assert await svc.step_once() is None
        await other.release()

        # the SFT step (another "process": its own engine, lock and model) is step 2 ...
        sft_config = config.model_copy(update={"learning_rate": SFT_LR})
        out = await run_sft(db_url, sft_config, str(tiny_model_dir), "tiny", file=str(chats), epochs=5)
        assert out["step"] == 2
        # ... and the trainer's next step is 3, trained from the SFT'd weights, not from its own step 1
        assert (await svc.step_once())["step"] == 3  # type: ignore[index]
    finally:
        await svc.stop()
    async with engine.connect() as conn:
        kinds = (
            await conn.execute(text("SELECT step, kind, num_runs FROM training_steps ORDER BY step"))
        ).all()
    assert [tuple(k) for k in kinds] == [(1, "grpo", 4), (2, "sft", 0), (3, "grpo", 4)]
    w1, w2, w3 = (lora_weights(ck, s) for s in (1, 2, 3))
    assert (w3 - w2).norm() < 0.5 * (w3 - w1).norm()
