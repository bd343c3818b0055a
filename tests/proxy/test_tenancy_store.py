"""Issue 22 cases 4 and 6: text the store cannot hold is refused at the edge, on SQLite and PostgreSQL.

Real proxies under uvicorn (`make_proxy`: what `rlproxy serve` builds) on a stub upstream, one on a
SQLite file and one on a fresh PostgreSQL database; raw bodies sent with httpx.

Before issue 22: a reward body with a lone surrogate passed the parser, could not be serialized, and
the writer retried and split its whole batch before a 500 (60 such posts made an honest reward 503);
on PostgreSQL one U+0000 in a message broke the `trajectories` view (`GET /v1/runs/{id}` a 500) and a
rubric holding it was a 500.
"""

from __future__ import annotations

import time

import httpx
import pytest
from test_replicas import pg_db  # noqa: F401  (a fresh PostgreSQL database per test)

SURROGATE = '{"reward": 0.5, "metadata": {"a": "\\ud800"}}'
NUL_CHAT = '{"model": "stub-model", "messages": [{"role": "user", "content": "a\\u0000b"}]}'
NUL_RESPONSES = '{"model": "stub-model", "input": "a\\u0000b"}'


@pytest.fixture(params=["sqlite", "postgresql"])
def proxy(request, make_proxy, stub):
    if request.param == "postgresql":
        return make_proxy(stub.url, db_url=request.getfixturevalue("pg_db"))
    return make_proxy(stub.url)


def _post(proxy, path: str, raw: str, run_id: str | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **({"X-Run-Id": run_id} if run_id else {})}
    return httpx.post(f"{proxy.url}{path}", content=raw, headers=headers, timeout=30)


def _refused(resp: httpx.Response) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] in (
        "invalid_text",
        "invalid_json",
    )


def test_case4_case6_text_the_store_cannot_hold_is_refused(proxy, stub):
    ok = _post(
        proxy,
        "/v1/chat/completions",
        '{"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}',
        "r-1",
    )
    assert ok.status_code == 200
    relayed = stub.requests
    # case 4: a lone surrogate in a reward's metadata, 60 times; then an honest reward, at once
    for _ in range(60):
        _refused(_post(proxy, "/v1/runs/r-1/reward", SURROGATE))
    t0 = time.monotonic()
    honest = _post(proxy, "/v1/runs/r-1/reward", '{"reward": 0.5}')
    assert honest.status_code == 200 and time.monotonic() - t0 < 5.0, honest.text
    # lone surrogates and U+0000 anywhere else: chat, Responses, a rubric
    _refused(_post(proxy, "/v1/chat/completions", NUL_CHAT, "r-2"))
    _refused(_post(proxy, "/v1/chat/completions", NUL_CHAT.replace("\\u0000", "\\udc00"), "r-2"))
    _refused(_post(proxy, "/v1/responses", NUL_RESPONSES, "r-2"))
    _refused(_post(proxy, "/v1/responses", NUL_RESPONSES.replace("\\u0000", "\\ud83d"), "r-2"))
    assert stub.requests == relayed  # nothing refused reached the upstream
    _post(
        proxy,
        "/v1/chat/completions",
        '{"model": "stub-model", "messages": [{"role": "user", "content": "x"}]}',
        "r-3",
    )
    _refused(_post(proxy, "/v1/runs/r-3/complete", '{"rubric": "be \\u0000 nice"}'))
    # case 6: the store still reads every run (the trajectories view, GET /v1/runs/{id})
    for run_id in ("r-1", "r-3"):
        got = httpx.get(f"{proxy.url}/v1/runs/{run_id}", timeout=30)
        assert got.status_code == 200, got.text
    assert httpx.get(f"{proxy.url}/v1/runs", timeout=30).status_code == 200
    assert proxy.state.writer.dropped == 0
