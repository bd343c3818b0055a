"""U+0000 from the upstream (issue 55): a model's answer holding NUL is stored so that the run still
reads, on SQLite and PostgreSQL: `GET /v1/runs/{id}` for all six route/stream forms, and the export.

Clients cannot send U+0000 (refused at the edge: test_tenancy_store.py), but the upstream can
answer it. On the old code PostgreSQL stored it in a JSON column and the `trajectories` view's
`->>` could not read it back: `GET /v1/runs/{id}` was a 500 for every form, the export failed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from test_replicas import pg_db  # noqa: F401  (a fresh PostgreSQL database per test)

from rlproxy.storage import export
from rlproxy.storage.db import create_engine

BODIES = {
    "chat": (
        "/v1/chat/completions",
        {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]},
    ),
    "responses": ("/v1/responses", {"model": "stub-model", "input": "hi"}),
    "messages": (
        "/v1/messages",
        {"model": "stub-model", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    ),
}


@pytest.fixture(params=["sqlite", "postgresql"])
def proxy(request: Any, make_proxy: Any, stub: Any) -> Any:
    stub.answer_text = "a\x00b"  # every answer holds U+0000
    if request.param == "postgresql":
        return make_proxy(stub.url, db_url=request.getfixturevalue("pg_db"))
    return make_proxy(stub.url)


def test_an_answer_holding_nul_is_stored_readable(proxy: Any, stub: Any) -> None:
    runs = []
    for name, (path, body) in BODIES.items():
        for stream in (False, True):
            run_id = f"nul-{name}-{int(stream)}"
            r = httpx.post(
                f"{proxy.url}{path}", json={**body, "stream": stream}, headers={"X-Run-Id": run_id}
            )
            assert r.status_code == 200, r.text
            runs.append(run_id)
    # an upstream's refusal whose body holds a raw NUL byte: stored as an error row (a text column)
    stub.fail_next.append((400, b'{"error": {"message": "bad \x00 input"}}'))
    r = httpx.post(
        f"{proxy.url}/v1/chat/completions", json=BODIES["chat"][1], headers={"X-Run-Id": "nul-err"}
    )
    assert r.status_code == 400
    runs.append("nul-err")
    proxy.flush()
    assert proxy.state.writer.dropped == 0
    assert proxy.state.writer.write_errors == 0
    for run_id in runs:
        got = httpx.get(f"{proxy.url}/v1/runs/{run_id}", timeout=30)
        assert got.status_code == 200, (run_id, got.text)
        completion = got.json()["completions"][0]
        if run_id != "nul-err":
            assert completion["status"] == "ok"
            assert got.json()["messages"][-1]["content"] in ("a\ufffdb", "a\x00b"), got.json()["messages"]
    assert httpx.get(f"{proxy.url}/v1/runs", timeout=30).status_code == 200

    async def exported() -> list[dict]:
        engine = create_engine(proxy.state.settings.db_url)
        try:
            return [r async for r in export.records(engine)]
        finally:
            await engine.dispose()

    rows = asyncio.run(exported())
    assert sorted(r["run_id"] for r in rows) == sorted(runs)
