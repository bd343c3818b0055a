"""The shadow check (issue 54, trainer/shadow.py): a new step answers stored prompts beside the serving
step and goes live only when it does not lose by more than shadow_margin.

End to end with the tiny model, `serve`'s app and the real `checks` scorer (an answer cut by its
request's max_tokens scores 0, one that ends scores 1; the tiny model's base almost never ends within
4 tokens): step 1 is an adapter trained to end at once (honest: it wins its check and serves); step 2
is the adapter put back to the base's weights, so it always hits the length cap (clearly worse than
the step serving): it is stopped before the app ever reaches it, and step 3 is built from step 1.
Then a real GRPO step trained on inverted rewards (the app rewards answers cut by max_tokens) with a
large learning rate: stopped too. And a scorer that fails: the step waits unserved, then passes on
the retry; one that never answers: rolled back after scorer_max_attempts. The parts: test_shadow_rule.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serving import rows, serving
from support import free_port

import rlproxy.trainer.service as service_module
from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.settings import Settings
from rlproxy.trainer import scorers
from rlproxy.trainer.scorers import ScoreRequest, ScorerError, check_scores
from rlproxy.trainer.step import StepResult, train_step

REAL_STEP = train_step

PLAN: list[str] = []  # what the stand-in trainer builds next: "honest" or "worse"
BUILT_FROM: list[int] = []  # the step whose weights each step started from


def _prompt_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _end_half_the_time(model: Any, tokenizer: Any, lora: list[tuple[str, Any]]) -> None:
    """Train the adapter until p(end) at an answer's first token is ~0.5 (the checks score ~0.5)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [_prompt_ids(tokenizer, f"Teach {k}: say something.") for k in range(4)]
    opt = torch.optim.Adam([p for _, p in lora], lr=0.01)
    half = torch.log(torch.tensor(0.5))
    model.train()
    with torch.enable_grad():
        for _ in range(200):
            lp = torch.stack(
                [torch.log_softmax(model(torch.tensor([i])).logits[0, -1], -1)[eos] for i in prompts]
            )
            if bool(((lp.exp() - 0.5).abs() < 0.05).all()):
                break
            loss = ((lp - half) ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()


def _stand_in_step(
    model: Any, tokenizer: Any, optimizer: Any, runs: list[Any], config: Any, step: int = 0
) -> StepResult:
    """train_step's stand-in: an adapter that ends every answer at once (honest: the checks score 1),
    or the adapter zeroed back to the base, which is cut by max_tokens (worse: 0)."""
    if not PLAN:  # a real GRPO step
        return REAL_STEP(model, tokenizer, optimizer, runs, config, step)
    BUILT_FROM.append(step)
    kind = PLAN.pop(0)
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "half":
        _end_half_the_time(model, tokenizer, lora)
    elif kind == "worse":
        with torch.no_grad():
            for n, p in lora:
                if "lora_B" in n:
                    p.zero_()
    else:
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        prompts = [_prompt_ids(tokenizer, f"Teach {k}: say something.") for k in range(4)]
        opt = torch.optim.Adam([p for _, p in lora], lr=0.02)
        model.train()
        with torch.enable_grad():
            for _ in range(60):
                loss = sum(
                    -torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)[eos] for ids in prompts
                )
                opt.zero_grad()
                loss.backward()
                opt.step()
                if loss.item() < 4 * 1e-4:  # p(end) > 0.9999 on each
                    break
        model.eval()
    return StepResult(num_groups=1, num_runs=len(runs), num_tokens=1, mean_reward=0.5, loss=0.0, metrics={})


async def _wait(db: Path, sql: str, seconds: float = 120.0) -> list[tuple]:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = rows(db, sql)
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {sql}")


@pytest.mark.timeout(600)
async def test_an_honest_step_passes_and_a_worse_one_never_serves(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_module, "train_step", _stand_in_step)
    PLAN[:] = ["honest", "worse", "honest"]
    BUILT_FROM.clear()
    db = tmp_path / "rlproxy.db"
    settings = Settings(
        model=str(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{db}",
        port=free_port(),
        train=True,
        group_size=4,
        groups_per_step=1,
        poll_interval=0.1,
        policy_poll_interval=0.1,
        checkpoint_dir=str(tmp_path / "ck"),
        unload_grace=0.2,
        train_threads=1,
        engine_threads=1,
        shadow_prompts=8,
        shadow_margin=0.05,
        scorer="checks",
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    served: list[tuple[float, int]] = []  # (time, X-Policy-Step) of every app request
    async with serving(settings, backend) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        policy = backend.served_model

        async def ask(text: str, run_id: str | None = None) -> int:
            headers = {"X-Run-Id": run_id} if run_id else {}
            body = {"model": policy, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
            r = await http.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            step = int(r.headers["x-policy-step"])
            served.append((time.monotonic(), step))
            return step

        async def group(g: int) -> None:
            for k in range(4):
                await ask(f"Group {g} task: say a word.", f"g{g}-r{k}")
                r = await http.post(f"/v1/runs/g{g}-r{k}/reward", json={"reward": float(k % 2)})
                assert r.status_code == 200, r.text

        async def app(stop: asyncio.Event) -> None:  # the app's untagged traffic, all along
            i = 0
            while not stop.is_set():
                await ask(f"Question {i}: name a color.")
                i += 1
                await asyncio.sleep(0.02)

        for i in range(10):  # stored prompts nobody trained on
            await ask(f"Before {i}: name a city.")
        stop = asyncio.Event()
        traffic = asyncio.create_task(app(stop))
        try:
            await group(1)
            await _wait(db, "SELECT 1 FROM training_steps WHERE step = 1")
            while served[-1][1] != 1:
                await asyncio.sleep(0.05)
            live_1 = time.monotonic()
            await group(2)
            await _wait(db, "SELECT 1 FROM shadow_checks WHERE candidate_step = 2 AND status = 'failed'")
            await _wait(db, "SELECT 1 FROM training_steps WHERE step = 2 AND adapter_path IS NULL")
            await asyncio.sleep(1.0)  # the app goes on: still step 1
            after_2 = time.monotonic()
            await group(3)
            await _wait(db, "SELECT 1 FROM shadow_checks WHERE candidate_step = 3 AND status != 'running'")
        finally:
            stop.set()
            await traffic
        page = await http.get("/v1/training/shadow_checks")
        assert page.status_code == 200
        api_rows = page.json()["data"]

    checks = rows(
        db,
        "SELECT candidate_step, serving_step, status, prompts, candidate_score, serving_score, margin, "
        "scorer, json_array_length(pairs) FROM shadow_checks ORDER BY candidate_step",
    )
    print("shadow checks:", checks)
    assert checks[0] == (1, 0, "passed", 8, 1.0, checks[0][5], 0.05, "checks", 8)
    assert checks[0][5] <= 0.25  # the base is cut by max_tokens on (almost) every prompt
    assert checks[1][:4] == (2, 1, "failed", 8) and checks[1][5] == 1.0 and checks[1][4] <= 0.25
    assert checks[2][:3] == (3, 1, "passed")
    assert [r["candidate_step"] for r in api_rows] == [3, 2, 1]  # the admin route, newest first
    reason = rows(db, "SELECT reason FROM shadow_checks WHERE candidate_step = 2")[0][0]
    assert "vs serving 1.000 on 8 prompts" in reason

    rollouts = rows(
        db, "SELECT candidate_step, incumbent_step, status, decided_by, fraction, reason FROM rollouts"
    )
    assert len(rollouts) == 1 and rollouts[0][:5] == (2, 1, "rolled_back", "shadow", 0.0), rollouts
    assert rollouts[0][5].startswith("shadow: candidate ") and "vs serving 1.000" in rollouts[0][5]

    # step 2 never served an app request: not during its check, not after; its weights are gone
    assert rows(db, "SELECT count(*) FROM completions WHERE policy_step = 2") == [(0,)]
    assert all(s == 1 for t, s in served if live_1 <= t <= after_2), [s for t, s in served if t >= live_1]
    assert not (tmp_path / "ck" / policy / "step-0002").exists()
    assert (tmp_path / "ck" / policy / "step-0003").exists()
    assert BUILT_FROM == [0, 1, 1]  # step 3 started from step 1's checkpoint, not from the rejected 2
    # the shadow samples (8 prompts x 2 steps x 3 checks) went to the engine, never captured
    assert rows(db, "SELECT count(*) FROM completions") == [(len(served),)]


@pytest.mark.timeout(600)
async def test_a_step_trained_on_inverted_rewards_is_stopped(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 ends its answers about half the time; the app then rewards answers CUT by max_tokens
    (inverted: the scorer prefers ones that end), and a real GRPO step with a large learning rate
    learns to end less: its check fails and it never serves."""
    monkeypatch.setattr(service_module, "train_step", _stand_in_step)
    PLAN[:] = ["half"]  # then real steps
    BUILT_FROM.clear()
    db = tmp_path / "rlproxy.db"
    settings = Settings(
        model=str(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{db}",
        port=free_port(),
        train=True,
        group_size=8,
        groups_per_step=2,
        poll_interval=0.1,
        policy_poll_interval=0.1,
        learning_rate=0.05,
        checkpoint_dir=str(tmp_path / "ck"),
        unload_grace=0.2,
        train_threads=1,
        engine_threads=1,
        shadow_prompts=16,
        shadow_margin=0.05,
        scorer="checks",
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    async with serving(settings, backend) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        policy = backend.served_model

        async def ask(text: str, run_id: str | None = None) -> tuple[int, str]:
            headers = {"X-Run-Id": run_id} if run_id else {}
            body = {"model": policy, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
            r = await http.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            return int(r.headers["x-policy-step"]), r.json()["choices"][0]["finish_reason"]

        async def run(g: int, k: int, inverted: bool) -> None:
            _, finish = await ask(f"Group {g} task: say a word.", f"g{g}-r{k}")
            reward = float(finish == "length") if inverted else float(k % 2)
            r = await http.post(f"/v1/runs/g{g}-r{k}/reward", json={"reward": reward})
            assert r.status_code == 200, r.text

        for i in range(20):  # stored prompts nobody trained on
            await ask(f"Before {i}: name a city.")
        for g in (0, 1):
            await asyncio.gather(*(run(g, k, False) for k in range(8)))
        await _wait(db, "SELECT 1 FROM training_steps WHERE step = 1")
        while (await ask("Now: name a color."))[0] != 1:
            await asyncio.sleep(0.05)
        g = 2
        while not rows(db, "SELECT 1 FROM shadow_checks WHERE candidate_step = 2 AND status != 'running'"):
            assert g < 40, "no second step"
            await asyncio.gather(*(run(g, k, True) for k in range(8)))
            g += 1
            await asyncio.sleep(0.2)
        for i in range(10):  # after the check: still step 1
            assert (await ask(f"After {i}: name a color."))[0] == 1

    checks = rows(
        db, "SELECT candidate_step, serving_step, status, candidate_score, serving_score FROM shadow_checks"
    )
    print("shadow checks:", checks, "groups sent:", g)
    assert checks[0][:3] == (1, 0, "passed")
    assert checks[1][:3] == (2, 1, "failed"), checks
    assert rows(db, "SELECT candidate_step, status, decided_by FROM rollouts") == [
        (2, "rolled_back", "shadow")
    ]
    assert rows(db, "SELECT count(*) FROM completions WHERE policy_step = 2") == [(0,)]


FAILS: dict[int, int] = {}  # candidate step -> scorer calls that fail before it answers


class FlakyScorer:
    """The checks, but failing its first FAILS[step] calls of a step's check (a scorer that is down)."""

    name = "flaky"

    async def score(self, req: ScoreRequest) -> list[float]:
        step = int(req.group_id.split("@")[1].split(":")[0])
        if FAILS.get(step, 0) > 0:
            FAILS[step] -= 1
            raise ScorerError("the scorer answered 503")
        return check_scores(req)


@pytest.mark.timeout(600)
async def test_a_scorer_failure_holds_the_step_back_then_retries(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1's first check fails (the scorer is down): it waits, unserved, and passes on the retry;
    step 2's scorer never answers: after scorer_max_attempts it is rolled back, never served."""
    monkeypatch.setattr(service_module, "train_step", _stand_in_step)
    monkeypatch.setattr(scorers, "build_scorer", lambda settings, client: FlakyScorer())
    PLAN[:] = ["honest", "honest"]
    BUILT_FROM.clear()
    FAILS.clear()
    FAILS.update({1: 1, 2: 1000})
    db = tmp_path / "rlproxy.db"
    settings = Settings(
        model=str(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{db}",
        port=free_port(),
        train=True,
        group_size=4,
        groups_per_step=1,
        poll_interval=0.1,
        policy_poll_interval=0.1,
        checkpoint_dir=str(tmp_path / "ck"),
        unload_grace=0.2,
        train_threads=1,
        engine_threads=1,
        shadow_prompts=4,
        scorer_timeout=0.5,  # also the wait before a check is tried again
        scorer_max_attempts=3,
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    async with serving(settings, backend) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        policy = backend.served_model

        async def ask(text: str, run_id: str | None = None) -> int:
            headers = {"X-Run-Id": run_id} if run_id else {}
            body = {"model": policy, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
            r = await http.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            return int(r.headers["x-policy-step"])

        async def group(g: int) -> None:
            for k in range(4):
                await ask(f"Group {g} task: say a word.", f"g{g}-r{k}")
                r = await http.post(f"/v1/runs/g{g}-r{k}/reward", json={"reward": float(k % 2)})
                assert r.status_code == 200, r.text

        for i in range(6):
            await ask(f"Before {i}: name a city.")
        await group(1)
        await _wait(db, "SELECT 1 FROM shadow_checks WHERE candidate_step = 1 AND status = 'error'")
        assert rows(db, "SELECT count(*) FROM training_steps") == [(0,)]  # waits, uncommitted
        assert await ask("Meanwhile: name a color.") == 0
        await _wait(db, "SELECT 1 FROM shadow_checks WHERE candidate_step = 1 AND status = 'passed'")
        await _wait(db, "SELECT 1 FROM training_steps WHERE step = 1")
        while await ask("Now: name a color.") != 1:
            await asyncio.sleep(0.05)
        await group(2)
        await _wait(db, "SELECT 1 FROM rollouts WHERE candidate_step = 2")
        for i in range(5):
            assert await ask(f"After {i}: name a color.") == 1

    [(status, reason)] = rows(db, "SELECT status, reason FROM shadow_checks WHERE candidate_step = 2")
    assert status == "error" and reason.startswith("no verdict after 3 attempt(s): the scorer answered 503")
    assert FAILS[2] == 1000 - 3
    [rollout] = rows(db, "SELECT candidate_step, incumbent_step, status, decided_by, reason FROM rollouts")
    assert rollout[:4] == (2, 1, "rolled_back", "shadow") and rollout[4].startswith(
        "shadow: no verdict after 3"
    )
    assert rows(db, "SELECT count(*) FROM completions WHERE policy_step = 2") == [(0,)]
    # nothing was served by step 1 before its check passed
    early = rows(
        db,
        "SELECT count(*) FROM completions WHERE policy_step = 1 AND julianday(created_at) < "
        "(SELECT julianday(finished_at) FROM shadow_checks WHERE candidate_step = 1)",
    )
    assert early == [(0,)]
