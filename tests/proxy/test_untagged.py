"""Untagged traffic (issue 26, item 2): a request without a run key is listed and counted, and the
app that got its response can reward it by the response's `id` (proxy/routes_untagged.py).

Today's code stored such a request with `run_id` NULL and nothing else: no listing, no count, and
`POST /v1/completions/{id}/reward` was relayed to the upstream (404). Real engine (tiny), real SDK.
"""

from __future__ import annotations

import httpx
import openai
import pytest

KEY, ADMIN = "sk-agents-untagged", "sk-admin-untagged"
ASK = [{"role": "user", "content": "Pick a number between 1 and 10."}]


def _ask(proxy, engine_backend, key: str | None, **headers: str) -> str:
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key or "none", max_retries=0)
    reply = client.chat.completions.create(
        model=engine_backend.served_model, messages=ASK, max_tokens=4, extra_headers=headers or None
    )
    return reply.id


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.mark.parametrize("key", [None, KEY], ids=["open", "key"])
def test_untagged_requests_are_listed_and_rewardable_by_reply_id(make_proxy, engine_backend, key):
    proxy = make_proxy(
        engine_backend.base_url, model=engine_backend.served_model, api_key=key, admin_key=ADMIN
    )
    first, second = _ask(proxy, engine_backend, key), _ask(proxy, engine_backend, key)
    assert first != second
    proxy.flush()

    listed = httpx.get(f"{proxy.url}/v1/admin/untagged", headers=_auth(ADMIN)).json()
    assert listed["total"] == 2 and [r["reply_id"] for r in listed["data"]] == [second, first]
    assert listed["data"][0]["status_code"] == 200 and listed["data"][0]["created_at"].endswith("+00:00")
    assert proxy.query("SELECT reply_id FROM untagged ORDER BY completion_id") == [(first,), (second,)]
    if key:  # listing every client's traffic is an operator's business
        assert httpx.get(f"{proxy.url}/v1/admin/untagged", headers=_auth(KEY)).status_code == 403
        refused = httpx.post(f"{proxy.url}/v1/completions/{first}/reward", json={"reward": 0.5})
        assert refused.status_code == 401

    url = f"{proxy.url}/v1/completions/{first}/reward"
    r = httpx.post(url, json={"reward": 0.5}, headers=_auth(key))
    assert r.status_code == 200, r.text
    assert r.json() == {"run_id": first, "reward": 0.5, "stored": True}
    # the reply is now a one-call run of its own, grouped like any run; it left the untagged list
    (run,) = proxy.query("SELECT id, status, reward, group_id, policy FROM runs")
    assert run[:3] == (first, "completed", 0.5) and run[3] and run[4] == engine_backend.served_model
    assert proxy.query("SELECT run_id, seq FROM completions WHERE run_id IS NOT NULL") == [(first, 0)]
    assert proxy.query("SELECT reply_id FROM untagged") == [(second,)]
    # the reward route's answers, as for a run: the same again 200, a different one 409
    again = httpx.post(url, json={"reward": 0.5}, headers=_auth(key))
    assert again.status_code == 200 and again.json()["stored"] is False
    assert httpx.post(url, json={"reward": 1.0}, headers=_auth(key)).status_code == 409
    assert httpx.get(f"{proxy.url}/v1/runs/{first}", headers=_auth(key)).json()["reward"] == 0.5


def test_reply_reward_refusals(make_proxy, engine_backend):
    proxy = make_proxy(engine_backend.base_url, model=engine_backend.served_model)
    tagged = _ask(proxy, engine_backend, None, **{"X-Run-Id": "secret-run-7"})
    lone = _ask(proxy, engine_backend, None)

    r = httpx.post(f"{proxy.url}/v1/completions/chatcmpl-nope/reward", json={"reward": 1.0})
    assert r.status_code == 404 and r.json()["error"]["code"] == "reply_not_found"
    r = httpx.post(f"{proxy.url}/v1/completions/{tagged}/reward", json={"reward": 1.0})
    assert r.status_code == 409 and r.json()["error"]["code"] == "reply_in_run"
    assert "secret-run-7" not in r.text  # the reply id is not a capability over its run
    r = httpx.post(f"{proxy.url}/v1/completions/a%20b/reward", json={"reward": 1.0})
    assert r.status_code == 400
    r = httpx.post(
        f"{proxy.url}/v1/completions/{lone}/reward",
        content=b'{"reward": NaN}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422
    # the reply became its run at the first post (an open run, no reward), and takes one later
    assert proxy.query("SELECT status, reward FROM runs WHERE id = ?", lone) == [("open", None)]
    ok = httpx.post(f"{proxy.url}/v1/completions/{lone}/reward", json={"reward": 1.0})
    assert ok.status_code == 200 and ok.json()["stored"] is True
    assert proxy.query("SELECT reward FROM runs WHERE id = 'secret-run-7'") == [(None,)]


def test_models_list_shows_names_not_paths(make_proxy, engine_backend):
    """Issue 22 case 14: `/v1/models` showed agents the model folder (and each adapter's checkpoint)."""
    proxy = make_proxy(engine_backend.base_url, model=engine_backend.served_model)
    for base in (f"{proxy.url}/v1", f"{proxy.url}/runs/ep-1/v1"):
        body = openai.OpenAI(base_url=base, api_key="none", max_retries=0).models.list().model_dump()
        assert body["data"] and body["data"][0]["id"] == engine_backend.served_model
        text = httpx.get(f"{base}/models").text
        assert "/" not in text.replace("\\/", ""), text  # no path anywhere in the answer
    from rlproxy.proxy.routes_models import names_only

    listed = {
        "data": [
            {"id": "m", "root": "/srv/models/m"},
            {"id": "m@3", "root": "/ck/m/step-0003", "parent": "/srv/models/m"},
        ]
    }
    assert names_only(listed)["data"] == [
        {"id": "m", "root": "m"},
        {"id": "m@3", "root": "m@3", "parent": "m"},
    ]
