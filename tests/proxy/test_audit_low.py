"""The audit's low findings (issue 55), each against a real proxy on a stub upstream; each test failed
on the code before its fix:

- `"model": "stub@²"` was a 500 (`"²".isdigit()` then `int("²")`);
- `?id=`, `?before=`, `?offset=`, `?limit=` past 2^63 on the operator routes were 500s;
- an unknown `GET /v1/responses/{id}` flushed the writer (a commit per unknown id);
- `GET /v1/runs/{id}` showed agents the upstream's address and its 5xx body in a row's error;
- an upstream's 5xx body (its traceback, its paths) reached the client as sent;
- the access log kept `?key=...`;
- `POST /v1/completions/{id}/complete` was relayed to the upstream;
- every refused reward logged `ERROR asyncio: Future exception was never retrieved` (the writer
  process's future) and nothing said why it was refused.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
TRACEBACK = (
    b'{"error": {"message": "Traceback (most recent call last):\\n  File \\"/srv/engine/secret_module.py\\", '
    b'line 7, in generate\\nRuntimeError: CUDA out of memory", "type": "InternalServerError", "code": 500}}'
)
AGENT, ADMIN = "agents-key", "admin-key"


def _h(key: str, run_id: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **({"X-Run-Id": run_id} if run_id else {})}


def test_a_unicode_digit_step_is_an_unknown_model(make_proxy: Any, stub: Any) -> None:
    proxy = make_proxy(stub.url)
    for model in ("stub-model@²", "stub-model@١", "stub-model@99999999999999999999999"):
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, "model": model})
        assert r.status_code == 404, (model, r.text)
        assert r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/training/rollouts?id=18446744073709551616",
        "/v1/admin/untagged?before=18446744073709551616",
        "/v1/admin/untagged?before=-18446744073709551616",
        "/v1/admin/runs?offset=18446744073709551616",
        "/v1/training/steps?limit=18446744073709551616",
        "/v1/training/steps?limit=-1",
    ],
)
def test_integers_past_64_bits_on_operator_routes_are_422(make_proxy: Any, stub: Any, path: str) -> None:
    proxy = make_proxy(stub.url)
    r = httpx.get(f"{proxy.url}{path}")
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] in ("id", "limit", "before", "offset")


def test_an_unknown_response_id_does_not_flush_the_writer(make_proxy: Any, stub: Any) -> None:
    proxy = make_proxy(stub.url)
    writer = proxy.state.writer
    flushes = 0
    flush = writer.flush

    async def counted() -> None:
        nonlocal flushes
        flushes += 1
        await flush()

    writer.flush = counted
    for i in range(5):
        r = httpx.get(f"{proxy.url}/v1/responses/resp_{i:032x}")
        assert r.status_code == 404
    assert flushes == 0
    # one just answered is found at once, queued or committed (the flush is for those)
    made = httpx.post(f"{proxy.url}/v1/responses", json={"model": "stub-model", "input": "hi"}).json()
    assert httpx.get(f"{proxy.url}/v1/responses/{made['id']}").json()["id"] == made["id"]


def test_agents_see_no_upstream_detail_and_no_5xx_body(make_proxy: Any, stub: Any, loop_thread: Any) -> None:
    stub.record = True
    proxy = make_proxy(stub.url, api_key=AGENT, admin_key=ADMIN)
    # an upstream 500 with a traceback: the client gets a generic error of the same status
    stub.fail_next.append((500, TRACEBACK))
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=_h(AGENT, "fail-1"))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "upstream_error" and "secret_module" not in r.text
    # the same on the pass-through (any other /v1 path)
    stub.fail_next.append((500, TRACEBACK))
    r = httpx.post(f"{proxy.url}/v1/other/completions", json=CHAT, headers=_h(AGENT))
    assert r.status_code == 500 and "secret_module" not in r.text, r.text
    # a 4xx body is the client's to read: relayed as sent
    stub.fail_next.append((400, b'{"error": {"message": "bad temperature", "type": "BadRequestError"}}'))
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=_h(AGENT, "fail-1"))
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad temperature"
    # the upstream gone: the row's error names its address
    loop_thread.run(stub.stop())
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=_h(AGENT, "fail-1"))
    assert r.status_code == 502 and stub.url not in r.text
    agent = httpx.get(f"{proxy.url}/v1/runs/fail-1", headers=_h(AGENT)).json()
    admin = httpx.get(f"{proxy.url}/v1/runs/fail-1", headers=_h(ADMIN)).json()
    assert [c["status_code"] for c in admin["completions"]] == [500, 400, 502]
    assert (
        "secret_module" in admin["completions"][0]["error"] and stub.url in admin["completions"][2]["error"]
    )
    assert "secret_module" not in str(agent) and stub.url not in str(agent)
    assert agent["completions"][1]["error"] == admin["completions"][1]["error"]  # the refusal it got


def test_secret_query_values_are_not_in_the_access_log(caplog: pytest.LogCaptureFixture) -> None:
    from rlproxy.proxy.server import ACCESS_LOGGER

    caplog.set_level(logging.INFO, logger="rlproxy.access")
    path = "/?key=sk-admin-secret&page=2&API_KEY=sk-2&%74oken=sk-3"
    # the call uvicorn's protocol makes for each response (httptools_impl.RequestResponseCycle.send)
    ACCESS_LOGGER.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "GET", path, "1.1", 200)
    line = caplog.records[-1].getMessage()
    assert "sk-" not in line and "page=2" in line and line.count("[redacted]") == 3


def test_complete_by_reply_id_is_served_not_relayed(make_proxy: Any, stub: Any) -> None:
    stub.record = True
    proxy = make_proxy(stub.url)
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT).json()["id"]
    r = httpx.post(f"{proxy.url}/v1/completions/{reply}/complete", json={})
    assert r.status_code == 200 and r.json() == {
        "run_id": reply,
        "reward": None,
        "judge": True,
        "stored": True,
    }
    assert proxy.query("SELECT status FROM runs WHERE id = ?", reply) == [("completed",)]
    assert not any(b"/complete" in s[1] for s in stub.seen)


def test_refused_rewards_are_a_line_not_an_unretrieved_future(
    make_proxy: Any, stub: Any, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rlproxy.proxy.routes_runs")
    proxy = make_proxy(stub.url)
    httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={"X-Run-Id": "r-1"}).raise_for_status()
    assert httpx.post(f"{proxy.url}/v1/runs/r-1/reward", json={"reward": 1.0}).status_code == 200
    assert httpx.post(f"{proxy.url}/v1/runs/r-1/reward", json={"reward": 0.0}).status_code == 409
    assert httpx.post(f"{proxy.url}/v1/runs/nope/reward", json={"reward": 1.0}).status_code == 404
    proxy.stop()  # the writer process ends: what it wrote to stderr is all there
    err = capfd.readouterr().err
    assert "never retrieved" not in err, err
    said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(said) == 2 and "409" in said[0] and "404" in said[1], said
