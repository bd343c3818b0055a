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
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import free_port
from trainer.serving import serving

from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.settings import Settings
from rlproxy.trainer import siblings as sib
from rlproxy.trainer.scorers import ChecksScorer, ScoreRequest

MSGS = [{"role": "user", "content": "Name a color."}]


def rows(db: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


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
    monkeypatch.setattr(sib, "build_scorer", lambda settings, client: RankedChecks())
    db = tmp_path / "rlproxy.db"
    settings = Settings(
        model=str(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{db}",
        port=free_port(),
        train=True,
        groups_per_step=1,
        poll_interval=0.1,
        checkpoint_dir=str(tmp_path / "ck"),
        train_threads=1,
        engine_threads=1,
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
