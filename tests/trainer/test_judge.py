"""Judge rewards end to end: runs completed without a number, scored by a judge, trained on its scores.

The proxy is `build_app` (what `rlproxy serve` runs) on the embedded engine with the tiny model,
under a real uvicorn server; the app is the openai SDK. The judge is either a stub OpenAI server on
a loopback port (exact scores, malformed answers, what it was shown) or the tiny model itself, the
default judge (the proxy's own upstream), whose random text is never valid JSON.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from sqlalchemy import text
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support import free_port, rows, tiny_settings, uvicorn_serving, wait_for

from rlproxy.compose import build_app
from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.settings import JudgeSettings
from rlproxy.storage.training import ready_groups
from rlproxy.trainer.judge import Judge
from rlproxy.trainer.judge_prompt import JudgeOutputError, parse_scores, render_trajectory


class StubJudge:
    """An OpenAI-compatible judge that answers the queued texts in order (the last one forever)."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.requests: list[dict[str, Any]] = []
        self.port = free_port()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        text = self.answers[min(len(self.requests), len(self.answers)) - 1]
        usage = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        return JSONResponse({"id": "j", "object": "chat.completion", "choices": [choice], "usage": usage})

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[StubJudge]:
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
        async with uvicorn_serving(app, self.port, start_timeout=30):
            yield self


@asynccontextmanager
async def proxy(tiny: Path, tmp: Path, **overrides: Any) -> AsyncIterator[tuple[str, Any, Path]]:
    """(base URL, app state, db path) of a proxy with the trainer on, serving the tiny model."""
    values: dict[str, Any] = {
        "group_size": 4,
        "groups_per_step": 1,
        "poll_interval": 0.1,
        "learning_rate": 1e-3,
    }
    settings = tiny_settings(tiny, tmp, **(values | overrides))
    app = build_app(settings, EmbeddedBackend(str(tiny), threads=1))
    async with uvicorn_serving(app, settings.port, start_timeout=120) as base:
        yield base, app.state.proxy, tmp / "rlproxy.db"


async def play_group(base: str, policy: str, group: str, n: int = 4) -> list[str]:
    """n runs of one task through the proxy, each completed for the judge (no number)."""
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
    run_ids = []
    async with httpx.AsyncClient(base_url=base) as http:
        for i in range(n):
            run_id = f"{group}-{i}"
            await client.chat.completions.create(
                model=policy,
                messages=[{"role": "user", "content": f"Task {group}: say a word."}],
                max_tokens=4,
                temperature=1.0,
                seed=i,
                extra_headers={"X-Run-Id": run_id, "X-Group-Id": group},
            )
            # both forms of the contract: the complete route, and a reward body asking for the judge
            # one rubric per group (issue 22): every run of the group names the same one
            if i % 2 == 0:
                body = {"rubric": "Longer words are better."}
                resp = await http.post(f"/v1/runs/{run_id}/complete", json=body)
            else:
                body = {"judge": True, "rubric": "Longer words are better."}
                resp = await http.post(f"/v1/runs/{run_id}/reward", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json() == {"run_id": run_id, "reward": None, "judge": True, "stored": True}
            run_ids.append(run_id)
    return run_ids


def scores_json(scores: list[float]) -> str:
    entries = [
        {"trajectory_id": str(i), "explanation": f"reason {i}", "score": s} for i, s in enumerate(scores, 1)
    ]
    return json.dumps({"scores": entries})


# ---------------------------------------------------------------------------------------- parsing


def test_parse_scores_accepts_the_shapes_judges_write() -> None:
    asked = '{"scores": [{"trajectory_id": "1", "explanation": "good", "score": 0.75}, ' + (
        '{"trajectory_id": "2", "explanation": "bad", "score": 0}]}'
    )
    assert parse_scores(asked, 2) == [(0.75, "good"), (0.0, "bad")]
    fenced = 'Sure!\n```json\n{"scores": [{"id": 2, "score": "0.5"}, {"id": 1, "score": 1}]}\n```\nDone.'
    assert parse_scores(fenced, 2) == [(1.0, ""), (0.5, "")]
    assert parse_scores('{"1": 0.25, "2": {"score": 0.5, "reason": "ok"}}', 2) == [(0.25, ""), (0.5, "ok")]
    assert parse_scores('[{"score": 0.1}, {"score": 0.2}]', 2) == [(0.1, ""), (0.2, "")]


@pytest.mark.parametrize(
    "text",
    [
        "I think the first one is better.",  # no JSON
        '{"scores": [{"trajectory_id": "1", "score": 0.5}]}',  # one of two scored
        '{"scores": [{"trajectory_id": "1", "score": 1.5}, {"trajectory_id": "2", "score": 0}]}',  # > 1
        '{"scores": [{"trajectory_id": "1", "score": true}, {"trajectory_id": "2", "score": 0}]}',  # bool
        '{"scores": [{"trajectory_id": "1", "score": NaN}, {"trajectory_id": "2", "score": 0}]}',
        '{"scores": [{"trajectory_id": "1", "score": 1}, {"trajectory_id": "1", "score": 0}]}',  # repeated
        '{"scores": [{"trajectory_id": "3", "score": 1}, {"trajectory_id": "1", "score": 0}]}',  # unknown id
        '{"scores": [{"trajectory_id": "1", "score": "high"}, {"trajectory_id": "2", "score": 0}]}',
    ],
)
def test_parse_scores_rejects_malformed_answers(text: str) -> None:
    with pytest.raises(JudgeOutputError):
        parse_scores(text, 2)


def test_long_trajectories_keep_their_start_and_end() -> None:
    text = render_trajectory([{"role": "user", "content": "TASK" + "x" * 5000 + "ANSWER"}], 1000)
    assert len(text) < 1100 and "TASK" in text and text.endswith('ANSWER"') and "left out" in text


# ---------------------------------------------------------------------------------------- end to end


async def test_judged_group_is_trained_on_the_judges_scores(tiny_model_dir: Path, tmp_path: Path) -> None:
    # the first answer is malformed: the judge is asked again, and the second answer is the rewards
    stub = StubJudge(["the second one, clearly", scores_json([0.9, 0.1, 0.5, 0.0])])
    async with (
        stub.serving(),
        proxy(tiny_model_dir, tmp_path, judge_base_url=stub.base_url) as (base, px, db),
    ):
        policy = px.backend.served_model
        run_ids = await play_group(base, policy, "A")
        await wait_for(lambda: rows(db, "SELECT count(*) FROM training_steps")[0][0] == 1)
        got = rows(
            db,
            "SELECT id, reward, reward_source, judge_explanation, status, trained_step, judge_rubric "
            "FROM runs ORDER BY id",
        )
        assert [g[0] for g in got] == run_ids
        assert [g[1] for g in got] == [0.9, 0.1, 0.5, 0.0]
        assert {(g[2], g[4], g[5]) for g in got} == {("judge", "trained", 1)}
        assert [g[3] for g in got] == ["reason 1", "reason 2", "reason 3", "reason 4"]
        assert [g[6] for g in got] == ["Longer words are better."] * 4
        step = rows(db, "SELECT num_runs, mean_reward FROM training_steps")[0]
        assert step == (4, pytest.approx(0.375))
        # the judge was asked twice, with the run's rubric, every trajectory, and JSON mode
        assert len(stub.requests) == 2
        shown = stub.requests[0]["messages"]
        assert "Longer words are better." in shown[0]["content"]
        nonce = re.search(r"<trajectory-([0-9a-f]{16}) id=", shown[1]["content"]).group(1)
        assert all(f'<trajectory-{nonce} id="{i}">' in shown[1]["content"] for i in range(1, 5))
        assert shown[1]["content"].count("Task A: say a word.") == 4
        assert stub.requests[0]["response_format"] == {"type": "json_object"}
        # greedy first, then sampled: a greedy judge would repeat its malformed answer
        assert [r["temperature"] for r in stub.requests] == [0.0, 0.7]
        # judge calls are no training data: the store holds the app's 4 completions only
        assert rows(db, "SELECT count(*) FROM completions") == [(4,)]
        async with httpx.AsyncClient(base_url=base) as http:
            metrics = (await http.get("/metrics")).text
            # the contract around it: completing again is a no-op, a number now is a conflict
            again = await http.post(f"/v1/runs/{run_ids[0]}/complete", json={})
            assert again.status_code == 200 and again.json()["stored"] is False
            conflict = await http.post(f"/v1/runs/{run_ids[0]}/reward", json={"reward": 1.0})
            assert conflict.status_code == 409, conflict.text
    assert 'rlproxy_judge_calls_total{outcome="malformed"} 1.0' in metrics
    assert 'rlproxy_judge_calls_total{outcome="ok"} 1.0' in metrics
    assert 'rlproxy_judge_tokens_total{kind="prompt"} 200.0' in metrics
    assert 'rlproxy_judge_groups_total{outcome="scored"} 1.0' in metrics
    assert "rlproxy_judge_latency_seconds_count 2.0" in metrics


async def test_always_malformed_judge_fails_the_group_visibly(tiny_model_dir: Path, tmp_path: Path) -> None:
    stub = StubJudge(['{"scores": [{"trajectory_id": "1", "score": 0.7}]}'])  # one score for four runs
    settings = {"judge_base_url": stub.base_url, "judge_max_attempts": 3}
    async with stub.serving(), proxy(tiny_model_dir, tmp_path, **settings) as (base, px, db):
        await play_group(base, px.backend.served_model, "B")
        await wait_for(lambda: rows(db, "SELECT count(*) FROM runs WHERE status = 'failed'")[0][0] == 4)
        await asyncio.sleep(0.5)  # a few more polls: nothing else happens to a failed group
        async with httpx.AsyncClient(base_url=base) as http:
            metrics = (await http.get("/metrics")).text
        assert len(stub.requests) == 3
        assert rows(db, "SELECT DISTINCT status_reason, reward, reward_source FROM runs") == [
            ("judge_failed", None, "judge")
        ]
        assert rows(db, "SELECT count(*) FROM training_steps") == [(0,)]
    assert 'rlproxy_judge_calls_total{outcome="malformed"} 3.0' in metrics
    assert 'rlproxy_judge_groups_total{outcome="failed"} 1.0' in metrics


async def test_tiny_model_as_its_own_judge_fails_visibly(tiny_model_dir: Path, tmp_path: Path) -> None:
    # no judge_base_url: the judge is the proxy's own upstream (the embedded engine) and served model,
    # asked directly; the tiny model's random text is never a valid score list
    settings = {"judge_max_attempts": 2, "judge_max_tokens": 24, "judge_max_chars": 200, "group_size": 2}
    async with proxy(tiny_model_dir, tmp_path, **settings) as (base, px, db):
        await play_group(base, px.backend.served_model, "C", n=2)
        await wait_for(lambda: rows(db, "SELECT count(*) FROM runs WHERE status = 'failed'")[0][0] == 2)
        async with httpx.AsyncClient(base_url=base) as http:
            metrics = (await http.get("/metrics")).text
        assert rows(db, "SELECT DISTINCT status_reason FROM runs") == [("judge_failed",)]
        assert rows(db, "SELECT count(*) FROM training_steps") == [(0,)]
        assert rows(db, "SELECT count(*) FROM completions") == [(2,)]  # the judge's calls are not here
    assert 'rlproxy_judge_calls_total{outcome="malformed"} 2.0' in metrics
    assert 'rlproxy_judge_groups_total{outcome="failed"} 1.0' in metrics


async def test_complete_contract(tiny_model_dir: Path, tmp_path: Path) -> None:
    async with proxy(tiny_model_dir, tmp_path, train=False) as (base, px, db):
        client = AsyncOpenAI(base_url=f"{base}/runs/p-1/v1", api_key="unused")
        await client.chat.completions.create(
            model=px.backend.served_model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        plain = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        await plain.chat.completions.create(
            model=px.backend.served_model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_headers={"X-Run-Id": "r-2"},
        )
        async with httpx.AsyncClient(base_url=base) as http:
            # path form: "this run", and the named form whose ids must agree
            assert (await http.post("/runs/p-1/v1/runs/other/complete", json={})).status_code == 400
            ok = await http.post("/runs/p-1/v1/complete", json={"metadata": {"task": 1}})
            assert ok.status_code == 200, ok.text
            assert (await http.post("/v1/runs/nope/complete", json={})).status_code == 404
            assert (await http.post("/v1/runs/p-1/complete", json={"rubric": 3})).status_code == 422
            both = await http.post("/v1/runs/p-1/reward", json={"judge": True, "reward": 1})
            assert both.status_code == 422
            assert (await http.post("/v1/runs/r-2/reward", json={"reward": 0.5})).status_code == 200
            late = await http.post("/v1/runs/r-2/complete", json={})  # an app reward is there already
            assert late.status_code == 409, late.text
        got = rows(db, "SELECT id, status, reward, reward_source, json_extract(metadata, '$.task') FROM runs")
        assert sorted(got) == [("p-1", "completed", None, "judge", 1), ("r-2", "completed", 0.5, "app", None)]


async def test_judge_off_refuses_complete(tiny_model_dir: Path, tmp_path: Path) -> None:
    async with proxy(tiny_model_dir, tmp_path, train=False, judge="off") as (base, px, db):
        client = AsyncOpenAI(base_url=f"{base}/runs/q-1/v1", api_key="unused")
        await client.chat.completions.create(
            model=px.backend.served_model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        async with httpx.AsyncClient(base_url=base) as http:
            resp = await http.post("/v1/runs/q-1/complete", json={})
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "judge_off"
        await px.writer.flush()
        assert rows(db, "SELECT status, reward_source FROM runs") == [("open", None)]


# ---------------------------------------------------------------------------------------- the service alone


async def _set(engine: Any, sql: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(sql))


def _messages(task: str, answer: str) -> dict[str, Any]:
    return {
        "request": {"messages": [{"role": "user", "content": task}]},
        "response": {"choices": [{"message": {"role": "assistant", "content": answer}}]},
    }


async def test_judge_always_replaces_app_rewards(engine: Any, add_run: Any) -> None:
    for i, r in enumerate([1.0, 0.0]):
        await add_run(engine, f"a-{i}", reward=r, completions=[_messages("2+2?", str(3 + i))])
    await _set(engine, "UPDATE runs SET reward_source = 'app'")
    stub = StubJudge([scores_json([0.2, 0.8])])
    judge = Judge(JudgeSettings(judge="always", judge_base_url=stub.base_url, judge_model="judge-model"))
    (ready,) = await ready_groups(engine, group_size=2, group_timeout=600)
    assert judge.needs_judge(ready.policy, ready.sources)  # the trainer leaves it to the judge first
    async with stub.serving():
        assert await judge.judge_ready(engine, group_size=2, group_timeout=600) == 1
    await judge.close()
    (ready,) = await ready_groups(engine, group_size=2, group_timeout=600)
    assert ready.rewards == [0.2, 0.8] and not judge.needs_judge(ready.policy, ready.sources)
    async with engine.connect() as conn:
        got = (await conn.execute(text("SELECT id, reward_source, metrics FROM runs ORDER BY id"))).all()
    assert [(g[0], g[1], json.loads(g[2])) for g in got] == [
        ("a-0", "judge", {"app_reward": 1.0}),
        ("a-1", "judge", {"app_reward": 0.0}),
    ]
    assert stub.requests[0]["model"] == "judge-model"
    assert '[assistant] "3"' in stub.requests[0]["messages"][1]["content"]


async def test_unreachable_judge_leaves_the_group_waiting(engine: Any, add_run: Any) -> None:
    for i in range(2):
        await add_run(engine, f"w-{i}", reward=None, completions=[_messages("hi", "yo")])
    await _set(engine, "UPDATE runs SET reward_source = 'judge', completed_at = created_at")
    judge = Judge(
        JudgeSettings(judge_base_url=f"http://127.0.0.1:{free_port()}/v1", judge_model="m")
    )  # nobody listens
    assert await judge.judge_ready(engine, group_size=2, group_timeout=600) == 0
    assert judge.stats.calls["error"] == 1
    assert await judge.judge_ready(engine, group_size=2, group_timeout=600) == 0  # backing off: not asked
    assert judge.stats.calls["error"] == 1
    await judge.close()
    async with engine.connect() as conn:
        got = (await conn.execute(text("SELECT DISTINCT status, reward, reward_source FROM runs"))).all()
    assert [tuple(g) for g in got] == [("completed", None, "judge")]
