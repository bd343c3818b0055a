"""Siblings end to end (issue 54): `build_app` (what `rlproxy serve` runs) on the embedded engine with
the tiny model, `siblings=new`, K = 3, under uvicorn on loopback.

The app's answers are the engine's own (siblings never reach it, streamed or not); each call gets a
sibling group in SQL whose members hold the call's exact prompt ids, and whose sampled ids and
logprobs equal a direct seeded `/v1/completions` call to the engine; scored groups train in one
step. The budget, the queue bound, hosted calls and a failing scorer are tested on a stand-in engine.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from support import free_port, rows, tiny_settings
from trainer.serving import serving

from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.settings import Settings
from rlproxy.trainer import siblings as sib
from rlproxy.trainer.scorers import ChecksScorer, ScoreRequest

MSGS = [{"role": "user", "content": "Name a color."}]


class RankedChecks(ChecksScorer):
    """The built-in checks plus a spread by rank: groups of the tiny model's answers (all cut at
    max_tokens, so equal checks) still differ, and a step has something to learn."""

    name = "checks"

    async def score(self, req: ScoreRequest) -> list[float]:
        return [s + 0.1 * i for i, s in enumerate(await super().score(req))]


async def _wait(db: Path, sql: str, want: Any, timeout: float = 120.0) -> list[tuple]:
    for _ in range(int(timeout / 0.1)):
        got = rows(db, sql)
        if want(got):
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting on {sql!r}: {rows(db, sql)}")


async def test_siblings_never_reach_the_app_and_equal_a_seeded_sample(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sib, "build_scorer", lambda settings, client, **kw: RankedChecks())
    db = tmp_path / "rlproxy.db"
    settings = tiny_settings(
        tiny_model_dir,
        tmp_path,
        groups_per_step=1,
        poll_interval=0.1,
        siblings="new",
        siblings_k=3,
        scorer="checks",
        siblings_max_share=1.0,
    )
    # siblings off: what the app gets today (a fresh engine each, so no cache differs)
    off = settings.model_copy(
        update={"siblings": "off", "db_url": f"sqlite+aiosqlite:///{tmp_path / 'off.db'}"}
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    async with serving(off, backend) as base, httpx.AsyncClient(timeout=60) as http:
        want_plain, want_stream = await _app_calls(http, base, backend.served_model)
    assert rows(tmp_path / "off.db", "SELECT count(*) FROM sibling_groups") == [(0,)]

    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    async with serving(settings, backend) as base, httpx.AsyncClient(timeout=60) as http:
        plain, streamed = await _app_calls(http, base, backend.served_model)
        _same(plain, want_plain)
        _same(streamed, want_stream)
        engine_auth = {"Authorization": f"Bearer {backend.api_key}"}

        # a sibling group per call, K members, exact prompt ids, scored
        groups = await _wait(
            db,
            "SELECT id, completion_id, k, with_original, status FROM sibling_groups ORDER BY completion_id",
            lambda g: (
                len(g) == 2 and all(s in ("scored",) for *_, s in g) or any(s == "failed" for *_, s in g)
            ),
        )
        assert [(k, w, s) for _, _, k, w, s in groups] == [(3, 1, "scored")] * 2
        for gid, cid, *_ in groups:
            (app_prompt, app_tokens) = rows(
                db, f"SELECT prompt_token_ids, token_ids FROM completions WHERE id = {cid}"
            )[0]
            members = rows(
                db,
                "SELECT r.id, r.branch_of, r.reward_source, c.prompt_token_ids, c.token_ids, c.logprobs, "
                "c.request "
                f"FROM runs r JOIN completions c ON c.run_id = r.id WHERE r.group_id = '{gid}' ORDER BY r.id",
            )
            assert len(members) == 3
            assert all(m[1] == cid and json.loads(m[3]) == json.loads(app_prompt) for m in members)
            assert json.loads(members[0][4]) == json.loads(app_tokens)  # member 0: the app's own answer
            req = json.loads(members[1][6])
            assert req["seed"] == sib.seed_of(cid) and req["temperature"] == 1.0 and req["max_tokens"] == 5
            # a direct seeded sample of the same prompt ids: the same ids, the same logprobs
            again = await http.post(
                f"{backend.base_url}/v1/completions",
                headers=engine_auth,
                json={**req, "n": 2, "return_token_ids": True},
            )
            choices = sorted(again.json()["choices"], key=lambda c: c["index"])
            for m, c in zip(members[1:], choices, strict=True):
                assert json.loads(m[4]) == [c["token_ids"]]
                assert json.loads(m[5])[0] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-4)

        # scored groups are ready at once and train (groups_per_step=1)
        await _wait(db, "SELECT step FROM training_steps", lambda s: len(s) >= 1, timeout=180)
        trained = rows(db, "SELECT count(*) FROM runs WHERE status = 'trained' AND branch_of IS NOT NULL")
        assert trained[0][0] >= 3
        assert rows(db, "SELECT status FROM runs WHERE id IN ('r1', 'r2')") == [("open",), ("open",)]
        metrics = (await http.get(f"{base}/metrics")).text
        assert "rlproxy_siblings_sampled_total 4.0" in metrics
        assert 'rlproxy_siblings_groups_total{outcome="scored"} 2.0' in metrics


BODY = {"messages": MSGS, "max_tokens": 5, "temperature": 1.0, "seed": 7, "logprobs": True}


async def _app_calls(http: httpx.AsyncClient, base: str, model: str) -> tuple[list[Any], list[Any]]:
    """One plain and one streamed app call (runs r1, r2): what the app got of each."""
    url = f"{base}/v1/chat/completions"
    plain = await http.post(url, json={**BODY, "model": model}, headers={"X-Run-Id": "r1"})
    assert plain.status_code == 200
    (choice,) = plain.json()["choices"]  # one: never a sibling
    got = [(choice["index"], choice["message"], choice["logprobs"], choice["finish_reason"])]
    streamed = await _stream_text(http, url, {**BODY, "model": model, "stream": True}, {"X-Run-Id": "r2"})
    return got, streamed


def _same(got: list[Any], want: list[Any]) -> None:
    """The same choices, text and tokens exactly, logprobs to float noise."""
    assert len(got) == len(want)
    for (i, msg, lps, fin), (wi, wmsg, wlps, wfin) in zip(got, want, strict=True):
        assert (i, msg, fin) == (wi, wmsg, wfin)
        a = [t["logprob"] for t in (lps or {}).get("content") or []]
        b = [t["logprob"] for t in (wlps or {}).get("content") or []]
        assert a == pytest.approx(b, abs=1e-4)


async def _stream_text(http: httpx.AsyncClient, url: str, body: dict, headers: dict) -> list[Any]:
    """Index, delta, logprobs and finish reason of every chunk of a stream (ids and times differ)."""
    out: list[Any] = []
    async with http.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    out.append((c["index"], c.get("delta"), c.get("logprobs"), c.get("finish_reason")))
    return out


# ---------------------------------------------------------------- on a stand-in engine


class StandIn:
    """An engine that answers /v1/completions after `delay` s, counting requests in flight."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.in_flight = 0
        self.most = 0
        self.bodies: list[dict] = []
        self.spans: list[tuple[float, float]] = []

    def app(self) -> Any:
        from fastapi import FastAPI

        api = FastAPI()

        @api.get("/v1/models")
        async def models() -> dict:
            return {"data": [{"id": "base"}]}

        @api.post("/v1/completions")
        async def completions(body: dict) -> dict:
            loop = asyncio.get_running_loop()
            start = loop.time()
            self.bodies.append(body)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            await asyncio.sleep(self.delay)
            self.in_flight -= 1
            self.spans.append((start, loop.time()))
            choice = {"text": "hi", "finish_reason": "length", "token_ids": [1, 2]}
            choice["logprobs"] = {"token_logprobs": [-0.5, -0.5]}
            return {"choices": [{**choice, "index": i} for i in range(body["n"])]}

        return api


class Backend:
    def __init__(self, base_url: str) -> None:
        self.base_url, self.api_key = base_url, None


async def _standin(engine: StandIn) -> tuple[Any, asyncio.Task, str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(engine.app(), port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    return server, task, f"http://127.0.0.1:{port}"


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    from rlproxy.storage.db import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path / 'sib.db'}"
    upgrade(url)
    return Settings(db_url=url, siblings="new", siblings_k=2, siblings_max_share=1.0, **kw)


async def _store_calls(settings: Settings, n: int, **kw: Any) -> None:
    import dataclasses

    from storage.test_writer import rec

    from rlproxy.storage.db import create_engine
    from rlproxy.storage.writer import Writer

    engine = create_engine(settings.db_url)
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    for i in range(n):
        r = rec(
            f"{kw.get('policy', 'p')}-{kw.get('source')}-{i}", i, prompt_token_ids=[5, 6, i], adapter="base"
        )
        w.submit(dataclasses.replace(r, **kw))
    await w.close()
    await engine.dispose()


def _service(settings: Settings, url: str, **kw: Any) -> sib.SiblingService:
    from rlproxy.proxy.metrics import Metrics

    svc = sib.SiblingService(
        settings, settings.db_url, Backend(url), serving=lambda p: ("base", 0), poll_interval=0.05, **kw
    )
    svc.metrics = Metrics()
    svc.metrics.attach_siblings(svc)
    return svc


@pytest.mark.parametrize(("inflight", "share"), [(2, 1.0), (1, 0.5)])
async def test_budget_holds_under_a_burst(tmp_path: Path, inflight: int, share: float) -> None:
    settings = _settings(tmp_path, siblings_max_inflight=inflight)
    settings = settings.model_copy(update={"siblings_max_share": share})
    engine = StandIn(delay=0.15)
    server, task, url = await _standin(engine)
    svc = _service(settings, url)
    await svc.start()
    try:
        await _store_calls(settings, 3)  # served by "base", still loaded: K - 1 siblings + the app's
        await _store_calls(settings, 2, adapter="p@3", run_id=None)  # its step is gone: K fresh answers
        for _ in range(300):
            if svc.counts["sampled"] == 3 * 1 + 2 * 2:
                break
            await asyncio.sleep(0.05)
        assert svc.counts["sampled"] == 7
        assert engine.most == inflight  # the cap is reached and held
        assert {b.get("priority") for b in engine.bodies} == {10}
        assert sorted(b["n"] for b in engine.bodies) == [1, 1, 1, 2, 2]
        assert {b["model"] for b in engine.bodies} == {"base"}
        db = Path(settings.db_url.split("///")[1])
        got = rows(db, "SELECT k, with_original, count(*) FROM sibling_groups GROUP BY k, with_original")
        assert sorted(got) == [(2, 0, 2), (2, 1, 3)]
        if inflight == 1:  # after a request of t seconds the slot rests t * (1 - s) / s = t
            spans = sorted(engine.spans)
            gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
            assert min(gaps) >= 0.9 * 0.15
        assert 0 < svc.stats()["share"] <= 1.0
        text = svc.metrics.render().decode()
        assert "rlproxy_siblings_sampled_total 7.0" in text and "rlproxy_siblings_in_flight 0.0" in text
    finally:
        await svc.stop()
        server.should_exit = True
        await task


async def test_queue_bound_drops_and_hosted_calls_never_branch(tmp_path: Path) -> None:
    settings = _settings(tmp_path, siblings_queue=2)
    svc = _service(settings, "http://127.0.0.1:9", hosted=frozenset({"hp"}))
    from rlproxy.storage.db import create_engine

    svc._engine = create_engine(settings.db_url)
    try:
        await _store_calls(settings, 2, source="hosted")  # a hosted answer
        await _store_calls(settings, 2, policy="hp")  # a hosted policy
        assert await svc.poll_once() == 0 and svc.counts["dropped"] == 0
        await _store_calls(settings, 5)
        assert await svc.poll_once() == 2
        assert len(svc.queue) == 2 and svc.counts["dropped"] == 3
        assert {c.policy for c in svc.queue} == {"p"}
        assert 'rlproxy_siblings_groups_total{outcome="dropped"} 3.0' in svc.metrics.render().decode()
        assert "rlproxy_siblings_queue 2.0" in svc.metrics.render().decode()
    finally:
        await svc._engine.dispose()


async def test_a_scorer_that_fails_is_retried_then_the_group_fails(tmp_path: Path) -> None:
    from rlproxy.storage import siblings as store
    from rlproxy.storage.db import create_engine
    from rlproxy.trainer.scorers import ScorerError

    settings = _settings(tmp_path, scorer_max_attempts=2)
    svc = _service(settings, "http://127.0.0.1:9")
    svc._engine = create_engine(settings.db_url)
    calls: list[ScoreRequest] = []

    class Broken:
        name = "url"

        async def score(self, req: ScoreRequest) -> list[float]:
            calls.append(req)
            raise ScorerError("the scorer answered 500")

    svc.scorer = Broken()
    try:
        await _store_calls(settings, 1)
        (call,), _ = await store.new_calls(svc._engine, after=0)
        members = [store.Member([3, 4], [-1.0, -1.0], "<tool_call>", "stop")]
        body = store.sampled_request(
            "base", call.prompt_ids, max_tokens=4, temperature=1.0, top_p=1.0, stop=None
        )
        assert await store.create_group(
            svc._engine, group_id="g1", call=call, model="base", policy_step=0, members=members,
            request=body, with_original=True, temperature=1.0, sampled_tokens=2, sample_ms=1.0,
        )  # fmt: skip
        assert await svc.score_once() == 0
        assert len(calls) == 1 and calls[0].request == call.request and len(calls[0].candidates) == 2
        assert calls[0].candidates[0]["content"] == "a0"  # the app's stored answer
        assert await svc.score_once() == 0 and len(calls) == 1  # backing off
        svc._next_try.clear()
        assert await svc.score_once() == 0 and len(calls) == 2
        db = Path(settings.db_url.split("///")[1])
        assert rows(db, "SELECT status, attempts, error FROM sibling_groups") == [
            ("failed", 2, "the scorer answered 500")
        ]
        assert rows(db, "SELECT DISTINCT status, status_reason FROM runs WHERE group_id = 'g1'") == [
            ("failed", "scorer_failed")
        ]
        assert svc.counts["failed"] == 1
    finally:
        await svc._engine.dispose()


async def test_app_requests_go_first() -> None:
    from rlproxy.trainer.sibling_budget import Budget

    busy_until = asyncio.get_running_loop().time() + 0.3
    budget = Budget(1, 1.0, app_busy=lambda: asyncio.get_running_loop().time() < busy_until)
    await budget.acquire()
    assert asyncio.get_running_loop().time() >= busy_until
    budget.release(0.0)


def test_modes_parse() -> None:
    assert sib.parse_modes("off") == {"*": frozenset()}
    assert sib.parse_modes("new,plateau") == {"*": frozenset({"new", "plateau"})}
    modes = sib.parse_modes("agent=new+alone,*=off")
    assert sib.modes_of(modes, "agent") == {"new", "alone"} and sib.modes_of(modes, "x") == frozenset()
    with pytest.raises(ValueError):
        sib.parse_modes("sometimes")
    assert sum(sib.share_hit(i, 0.25) for i in range(4000)) == pytest.approx(1000, rel=0.1)
    assert sib.share_hit(17, 0.25) == sib.share_hit(17, 0.25)


def test_siblings_weight_scales_their_advantages(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A run's weight (a sibling group's: siblings_weight) scales its gradient: half the weight, half
    the gradient (the first step's, before any clipping)."""
    from rlproxy.storage.training import CompletionData, RunData
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy
    from rlproxy.trainer.step import make_optimizer, train_step

    config = TrainerConfig(learning_rate=1e-3, checkpoint_dir=str(tmp_path / "ck"), seed=0, max_grad_norm=1e9)

    def runs(weight: float) -> list[RunData]:
        out = []
        for i, (reward, tokens) in enumerate([(1.0, [11, 12, 13]), (0.0, [21, 22, 23])]):
            c = CompletionData(
                f"m{i}", 0, 0, "completions", {"temperature": 1.0}, None, [5, 17, 42], [tokens], None
            )
            out.append(RunData(f"m{i}", "sib-1", "tiny", reward, [c], sibling=True, weight=weight))
        return out

    norms = []
    for weight in (1.0, 0.5):
        model, tok = load_policy(str(tiny_model_dir), config)
        for name, p in model.named_parameters():  # lora_B starts at zero: no gradient reaches lora_A
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(0))
        result = train_step(model, tok, make_optimizer(model, config), runs(weight), config)
        norms.append(result.metrics["loss/grad_norm"])
    assert norms[1] == pytest.approx(0.5 * norms[0], rel=1e-3)
