"""Acceptance (issue 28): a canary with the real trainer on the tiny model, through `serve`'s app.

The app's reward depends on which step served the run (the response's `X-Policy-Step`): the base
model earns Bernoulli(0.5), step 1 is a good step (Bernoulli(0.9)), step 2 a broken one (reward
collapses to 0). With `rollout=canary` the trainer publishes step 1 -> its canary promotes it ->
the trainer (held meanwhile) trains step 2 from step 1 -> its canary rolls it back automatically ->
step 3 is trained from step 1's checkpoint and opens a canary against step 1. Every run has two
turns; the split over both closed canaries is within 5 points of canary_fraction over >= 200 runs,
and every run is served by one step (but a candidate's run whose step was rolled back mid-run: the
policy never serves a rolled-back step).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from serving import serving
from support import rows, tiny_settings

from rlproxy.inference.embedded import EmbeddedBackend

FRACTION = 0.3
REWARD = {0: 0.5, 1: 0.9}  # P(reward 1) of the step that served the run; any other step: 0 (broken)


async def one_run(
    client: AsyncOpenAI, http: httpx.AsyncClient, policy: str, i: int, rng: random.Random
) -> int:
    run_id, group = f"r{i:04d}", f"g{i // 4}"
    headers = {"X-Run-Id": run_id, "X-Group-Id": group}
    messages = [{"role": "user", "content": f"Task {group}: say a word."}]
    steps = []
    for _turn in range(2):
        raw = await client.chat.completions.with_raw_response.create(
            model=policy, messages=messages, max_tokens=2, temperature=1.0, seed=i, extra_headers=headers
        )
        steps.append(int(raw.headers["x-policy-step"]))
        messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or ""}]
        messages += [{"role": "user", "content": "and another"}]
    reward = float(rng.random() < REWARD.get(steps[0], 0.0))
    resp = await http.post(f"/v1/runs/{run_id}/reward", json={"reward": reward})
    assert resp.status_code == 200, resp.text
    return steps[0]


@pytest.mark.timeout(900)
async def test_canary_promotes_a_good_step_and_rolls_back_a_broken_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    resumed: list[str] = []  # the trainer's "resumed policy ... from <checkpoint>" lines
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: resumed.append(r.getMessage()) if "resumed" in r.getMessage() else None  # type: ignore[method-assign]
    trainer_log = logging.getLogger("rlproxy.trainer.service")
    level = trainer_log.level
    trainer_log.setLevel(logging.INFO)
    trainer_log.addHandler(handler)
    db = tmp_path / "rlproxy.db"
    settings = tiny_settings(
        tiny_model_dir,
        tmp_path,
        group_size=4,
        groups_per_step=1,
        poll_interval=0.1,
        policy_poll_interval=0.1,
        learning_rate=1e-3,
        unload_grace=0.5,
        rollout="canary",
        canary_fraction=FRACTION,
        canary_min_runs=40,
        canary_looks=2,
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    rng = random.Random(28)
    async with serving(settings, backend) as base:
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        policy = backend.served_model
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            i = 0
            for _ in range(300):  # batches of 8 concurrent runs until step 3's canary opens
                await asyncio.gather(*(one_run(client, http, policy, i + k, rng) for k in range(8)))
                i += 8
                done = rows(db, "SELECT count(*) FROM rollouts WHERE candidate_step = 3")[0][0]
                if done:
                    break
            # the router learns of step 3's canary at its next look (policy_poll_interval): wait for it
            gauge = 'rlproxy_rollout_step{arm="incumbent",policy="' + policy + '"} 1.0'
            for _ in range(100):
                metrics = (await http.get("/metrics")).text
                if gauge in metrics:
                    break
                await asyncio.sleep(0.1)
    got = rows(db, "SELECT candidate_step, incumbent_step, status, decided_by FROM rollouts ORDER BY id")
    assert got == [(1, 0, "promoted", "rule"), (2, 1, "rolled_back", "rule"), (3, 1, "canary", None)], got
    reasons = rows(db, "SELECT reason, candidate_runs, incumbent_runs FROM rollouts ORDER BY id")
    print("runs sent:", i, "rollouts:", reasons)

    # the split over the closed canaries: within 5 points of canary_fraction, over >= 200 runs
    arms = rows(db, "SELECT arm, count(*) FROM rollout_runs WHERE rollout_id IN (1, 2) GROUP BY arm")
    n = dict(arms)
    total = n["candidate"] + n["incumbent"]
    print(f"split: {n}, candidate share {n['candidate'] / total:.3f}")
    assert total >= 200
    assert abs(n["candidate"] / total - FRACTION) <= 0.05

    # every run on one step, but a run of the broken candidate when it was rolled back
    spans = rows(
        db,
        "SELECT run_id, group_concat(policy_step) FROM (SELECT run_id, policy_step FROM completions "
        "ORDER BY run_id, seq) GROUP BY run_id HAVING count(DISTINCT policy_step) > 1",
    )
    print(f"runs served by two steps (a rolled-back candidate's, finished on the incumbent): {len(spans)}")
    assert all(steps == "2,1" for _, steps in spans), spans
    assert len(spans) <= 8  # at most one batch was in flight at the rollback

    # the rolled-back step: deleted, never served again, never reloaded; step 3 came from step 1
    assert rows(db, "SELECT adapter_path FROM training_steps WHERE step = 2") == [(None,)]
    assert not (tmp_path / "ck" / policy / "step-0002").exists()
    # in this process the router re-reads at the decision: no request that arrived a moment after it
    # (the decision's commit and the re-read take milliseconds; other replicas: policy_poll_interval)
    decided = rows(db, "SELECT decided_at FROM rollouts WHERE candidate_step = 2")[0][0]
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    n_late, after_s = con.execute(
        "SELECT count(*), max(julianday(created_at) - julianday(?)) * 86400 FROM completions "
        "WHERE policy_step = 2 AND created_at > ?",
        (decided, decided),
    ).fetchone()
    con.close()
    print(f"step-2 completions started after the rollback: {n_late}, the last {after_s or 0:.3f} s after")
    assert n_late == 0 or after_s < 0.25
    trainer_log.removeHandler(handler)
    trainer_log.setLevel(level)
    assert any(m.endswith("step-0001") for m in resumed), resumed  # after the rollback: step 1's weights
    assert 'rlproxy_rollout_step{arm="incumbent",policy="' + policy + '"} 1.0' in metrics
