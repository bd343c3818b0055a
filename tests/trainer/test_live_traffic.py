"""Live traffic, where every task is unique: the batch baseline's exact numbers, lone runs leaving
`completed` for `ungrouped` (and trained with singletons=train), and the tiny model learning when no
prompt is ever seen twice."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import AsyncOpenAI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from support import ServerlessBackend, learning_config
from test_learning import favored_tokens, reward  # the same learnable reward as the GRPO learning test

from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.storage.training import RunData
from rlproxy.trainer import losses
from rlproxy.trainer.batches import baseline_index
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.service import TrainerService


def run(run_id: str, group_id: str, reward: float, ungrouped: bool = False) -> RunData:
    return RunData(run_id, group_id, "tiny", reward, ungrouped=ungrouped)


def test_batch_baseline_exact_numbers() -> None:
    """Ungrouped runs share one baseline whatever their group ids; grouped runs keep their group's."""
    runs = [
        run("a0", "A", 1.0),
        run("u0", "x", 0.2, ungrouped=True),
        run("a1", "A", 0.0),
        run("u1", "y", 0.8, ungrouped=True),
        run("u2", "z", 0.5, ungrouped=True),
    ]
    keys, index = baseline_index(runs)
    assert keys == [(False, "A"), (True, None)]
    assert index.tolist() == [0, 1, 0, 1, 1]
    rewards = torch.tensor([r.reward for r in runs], dtype=torch.float64)

    adv, m = losses.advantages(rewards, index, "group")
    # group A: mean 0.5, unbiased std sqrt(0.5); batch: mean 0.5, centered (-0.3, 0.3, 0), std 0.3
    s = 0.5**0.5
    expected = [0.5 / (s + 1e-4), -0.3 / (0.3 + 1e-4), -0.5 / (s + 1e-4), 0.3 / (0.3 + 1e-4), 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert adv[1].item() == pytest.approx(-0.999667, abs=1e-6)
    assert m["reward/frac_zero_std"] == 0.0

    adv, _ = losses.advantages(rewards, index, "none")  # REINFORCE with the batch mean as baseline
    assert adv.tolist() == pytest.approx([0.5, -0.3, -0.5, 0.3, 0.0], abs=1e-6)

    # a batch of one baseline: its only run has advantage 0 (no gradient), like a group of one
    keys, index = baseline_index([run("u", "x", 0.7, ungrouped=True)])
    adv, m = losses.advantages(torch.tensor([0.7], dtype=torch.float64), index, "group")
    assert adv.tolist() == [0.0] and m["reward/frac_zero_std"] == 1.0


def tokens(rng: random.Random) -> list[dict[str, Any]]:
    prompt = [rng.randrange(3, 1200) for _ in range(rng.randint(4, 10))]
    sampled = [rng.randrange(3, 1200) for _ in range(rng.randint(2, 6))]
    return [{"prompt_token_ids": prompt, "token_ids": [sampled], "logprobs": None}]


async def table(engine: AsyncEngine, sql: str) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        return [tuple(r) for r in await conn.execute(text(sql))]


async def test_fifty_singletons_leave_completed_then_train(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="rlproxy.trainer")
    rng = random.Random(0)
    for i in range(50):  # 50 unique tasks: each run is alone in its group
        await add_run(engine, f"s{i:02d}", group_id=f"task-{i}", reward=rng.random(), completions=tokens(rng))
    for i, r in enumerate([1.0, 0.0]):  # one task seen twice: a GRPO group, trained as one
        await add_run(engine, f"pair{i}", group_id="shared", reward=r, completions=tokens(rng))
    config = TrainerConfig(
        group_size=4,
        group_timeout=0.5,
        learning_rate=1e-3,
        checkpoint_dir=str(tmp_path / "ck"),
        train_threads=1,
        unload_grace=0.0,
    )
    svc = TrainerService(config, db_url, ServerlessBackend(tiny_model_dir))
    try:
        assert await svc.step_once() is None  # within group_timeout: siblings may still come
        assert await table(engine, "SELECT DISTINCT status FROM runs") == [("completed",)]
        await asyncio.sleep(0.6)
        m = await svc.step_once()  # the pair is a group past the timeout; the 50 lone runs leave
        assert m is not None and m["step"] == 1
        assert await svc.step_once() is None  # singletons=ungrouped: they are not trained
    finally:
        await svc.stop()
    by_status = await table(
        engine, "SELECT status, status_reason, count(*) FROM runs GROUP BY status, status_reason ORDER BY 1"
    )
    assert by_status == [("trained", None, 2), ("ungrouped", "no_sibling", 50)]
    assert await table(engine, "SELECT step, num_runs FROM training_steps") == [(1, 2)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("50 of 52 rewarded runs (96%) are ungrouped") for w in warnings), warnings
    assert any("RLPROXY_SINGLETONS=train" in w for w in warnings)

    # with the setting on, they train in batches of singleton_batch against the batch's mean reward
    await asyncio.sleep(1.0)  # the last short batch goes once its newest waited 2 x group_timeout
    trained = TrainerService(
        config.model_copy(update={"singletons": "train", "singleton_batch": 16}),
        db_url,
        ServerlessBackend(tiny_model_dir),
    )
    metrics = []
    try:
        while (m := await trained.step_once()) is not None:
            metrics.append(m)
    finally:
        await trained.stop()
    assert [m["step"] for m in metrics] == [2, 3, 4, 5]
    assert [m["reward/groups"] for m in metrics] == [1.0] * 4  # one baseline per step: its batch
    steps = await table(engine, "SELECT step, num_runs, num_groups FROM training_steps ORDER BY step")
    assert steps == [(1, 2, 1), (2, 16, 1), (3, 16, 1), (4, 16, 1), (5, 2, 1)]
    by_status = await table(
        engine, "SELECT status, status_reason, count(*) FROM runs GROUP BY status, status_reason ORDER BY 2"
    )
    assert by_status == [("trained", None, 2), ("trained", "no_sibling", 50)]
    # oldest first: the first batch is the first 16 rewarded
    first = await table(engine, "SELECT id FROM runs WHERE trained_step = 2 ORDER BY id")
    assert [r[0] for r in first] == [f"s{i:02d}" for i in range(16)]


ROUNDS = 20
BATCH = 16  # unique prompts per round, one sample each: every run is a group of one
MARGIN = 0.15


@pytest.mark.slow
async def test_reward_rises_when_every_prompt_is_unique(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """test_learning's loop where no prompt repeats: GRPO alone would never train (every run ungrouped);
    singletons=train trains each round's 16 runs against their batch's mean reward."""
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    await backend.start()
    favored = favored_tokens(tiny_model_dir)
    eos = backend.engine.tokenizer.eos_token_id
    config = learning_config(
        tmp_path,
        group_timeout=0.05,  # a run is alone for good 50 ms after its reward (every prompt is new)
        singletons="train",
        singleton_batch=BATCH,
    )
    svc = TrainerService(config, db_url, backend)
    client = AsyncOpenAI(base_url=f"{backend.base_url}/v1", api_key="unused")
    means: list[float] = []
    step = steps = 0
    try:
        for rnd in range(ROUNDS):
            model = "tiny" if step == 0 else f"tiny@{step}"
            rs = []
            for i in range(BATCH):  # one request per task, sequential: the same samples on every run
                resp = await client.completions.create(
                    model=model,
                    prompt=f"Request {rnd}-{i}: say a word.",  # never seen before, never seen again
                    max_tokens=8,
                    temperature=1.0,
                    seed=1000 * rnd + i,
                    logprobs=0,
                    extra_body={"return_token_ids": True},
                )
                ch = resp.model_dump()["choices"][0]
                r = reward(ch["token_ids"], favored, eos)
                rs.append(r)
                comp = {
                    "endpoint": "completions",
                    "prompt_token_ids": ch["prompt_token_ids"],
                    "token_ids": [ch["token_ids"]],
                    "logprobs": [ch["logprobs"]["token_logprobs"]],
                    "policy_step": step,
                    "adapter": model,
                }
                await add_run(
                    engine,
                    f"r{rnd}-{i}",
                    group_id=f"u{rnd}-{i}",
                    reward=r,
                    completions=[comp],
                    completed_ago=1,
                )
            means.append(sum(rs) / len(rs))
            m = await svc.step_once()
            if m is None:  # a batch with equal rewards was skipped
                continue
            steps += 1
            step = m["step"]
            assert m["reward/groups"] == 1.0  # one baseline: the batch
            assert m["clip/ratio_mean"] == pytest.approx(1.0, abs=0.02)  # sampled by these weights
    finally:
        await svc.stop()
        await backend.stop()
    first, last = sum(means[:3]) / 3, sum(means[-3:]) / 3
    print(f"mean reward per round: {[round(x, 3) for x in means]} first-3 {first:.3f} last-3 {last:.3f}")
    assert last > first + MARGIN, means
    rows = await table(engine, "SELECT status, status_reason, count(*) FROM runs GROUP BY 1, 2")
    assert rows == [("trained", "no_sibling", ROUNDS * BATCH)]
    assert (await table(engine, "SELECT count(*) FROM training_steps"))[0][0] == steps == ROUNDS
