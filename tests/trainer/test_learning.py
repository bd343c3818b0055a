"""Learning, small but real: the tiny model, sampled by the embedded engine, learns what the reward favors.

The loop is the product's loop without the proxy: sample groups from the engine (OpenAI SDK,
`return_token_ids` + `logprobs`, the current adapter `tiny@N`), store them as rewarded runs, let
`TrainerService.step_once` train, save, load the adapter into the engine and commit. The reward is
the fraction of sampled tokens in the lower half of the vocabulary: about 0.5 for the random model,
so every group has variance from the start. Seeds are fixed and torch runs on one thread, so the
run is deterministic; the margin leaves room for the differences between machines' float kernels.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import AsyncOpenAI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from support import learning_config

from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.trainer.service import TrainerService

ROUNDS = 24
GROUPS = 2  # prompts per step
N = 8  # samples per prompt
PROMPTS = ["Say a word.", "Name a color."]
MARGIN = 0.15


def favored_tokens(model_dir: Path) -> set[int]:
    """Half the vocabulary: the tokens whose embedding points along one fixed direction (seed 0).

    A random model's final norm bounds how far it can move its logits; along a direction of the
    (tied) embedding space it can move them most, so the task is learnable in a few steps.
    """
    from transformers import AutoModelForCausalLM

    emb = AutoModelForCausalLM.from_pretrained(model_dir).get_input_embeddings().weight.detach()
    u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    return set((emb @ u > 0).nonzero().flatten().tolist())


def reward(token_ids: list[int], favored: set[int], eos: int) -> float:
    """Partial credit: the share of sampled tokens (EOS aside) in the favored set."""
    toks = [t for t in token_ids if t != eos]
    return sum(t in favored for t in toks) / len(toks) if toks else 0.0


@pytest.mark.slow
async def test_mean_reward_rises(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="rlproxy.trainer")
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    await backend.start()
    favored = favored_tokens(tiny_model_dir)
    eos = backend.engine.tokenizer.eos_token_id
    config = learning_config(tmp_path, group_size=N, groups_per_step=GROUPS)
    svc = TrainerService(config, db_url, backend)
    client = AsyncOpenAI(base_url=f"{backend.base_url}/v1", api_key="unused")
    means: list[float] = []
    step = steps = varied = 0  # varied: groups whose rewards differ (a group of equal rewards is no signal)
    try:
        for rnd in range(ROUNDS):
            model = "tiny" if step == 0 else f"tiny@{step}"
            rs = []
            for g, prompt in enumerate(PROMPTS):
                group = []
                resp = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    n=N,
                    max_tokens=8,
                    temperature=1.0,
                    seed=1000 * rnd + g,
                    logprobs=True,
                    extra_body={"return_token_ids": True},
                )
                body = resp.model_dump()
                for i, ch in enumerate(body["choices"]):
                    r = reward(ch["token_ids"], favored, eos)
                    rs.append(r)
                    group.append(r)
                    comp = {
                        "prompt_token_ids": body["prompt_token_ids"],
                        "token_ids": [ch["token_ids"]],
                        "logprobs": [[c["logprob"] for c in ch["logprobs"]["content"]]],
                        "policy_step": step,
                        "adapter": model,
                    }
                    await add_run(
                        engine, f"r{rnd}-{g}-{i}", group_id=f"r{rnd}-{g}", reward=r, completions=[comp]
                    )
                varied += len(set(group)) > 1
            means.append(sum(rs) / len(rs))
            m = await svc.step_once()
            if m is None:  # a group with equal rewards was skipped: the other waits for a partner
                continue
            steps += 1
            step = m["step"]
            # sampled by the adapter being trained: the stored logprobs match the trainer's (ratio ~ 1)
            assert m["clip/ratio_mean"] == pytest.approx(1.0, abs=0.02)
    finally:
        await svc.stop()
        await backend.stop()
    first, last = sum(means[:3]) / 3, sum(means[-3:]) / 3
    print(f"mean reward per step: {[round(x, 3) for x in means]} first-3 {first:.3f} last-3 {last:.3f}")
    print(f"steps {steps}, groups with a reward spread {varied}")
    assert last > first + MARGIN, means
    async with engine.connect() as conn:
        n_steps = (await conn.execute(text("SELECT count(*) FROM training_steps"))).scalar()
    # every GROUPS groups with a reward spread make a step (a saturated group is skipped, its partner
    # waits for the next round's); at most one pair may still be waiting or age out at the end
    assert n_steps == steps >= varied // GROUPS - 1 >= ROUNDS // 2, (steps, varied)
