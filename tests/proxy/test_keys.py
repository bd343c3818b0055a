"""Issue 55: a key per app. Two apps with two keys on one proxy cannot read, reward, join, judge or
use each other's runs, replies, responses or policies; a revoke takes effect; limits are 429s.

Through a real proxy under uvicorn (`make_proxy`, what `rlproxy serve` builds) on the stub upstream
(which answers every call with the id `cmpl-stub`, as an upstream that repeats its ids would),
keys made with the store functions `rlproxy keys create` calls. Before issue 55 there were no app
keys: an app's key was refused (401), and under the one shared key every id below reached the
other app's data.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from rlproxy.storage import keys as keystore

AGENT, ADMIN = "shared-agents-key", "operators-key"
MSG = [{"role": "user", "content": "hi"}]
MAP = "shop-model=shop,bank-model=bank"


def _proxy(make_proxy, stub, **overrides):
    return make_proxy(stub.url, api_key=AGENT, admin_key=ADMIN, model_map=MAP, **overrides)


def _key(proxy, name: str, **fields) -> dict[str, str]:
    """A new key on `proxy`'s store, in force at once (no wait for the 2 s refresh): its auth header."""
    _, secret = proxy.lt.run(keystore.create(proxy.state.engine, name, **fields))
    proxy.lt.run(proxy.state.keys.refresh())
    return {"Authorization": f"Bearer {secret}"}


def _chat(proxy, auth, run_id=None, model="shop-model", group=None, **body) -> httpx.Response:
    headers = dict(auth)
    if run_id is not None:
        headers["X-Run-Id"] = run_id
    if group is not None:
        headers["X-Group-Id"] = group
    payload = {"model": model, "messages": MSG, **body}
    return httpx.post(f"{proxy.url}/v1/chat/completions", json=payload, headers=headers, timeout=30)


def _not_found(resp: httpx.Response, message: str) -> None:
    """The 404 an unknown run gets, word for word: nothing tells another app's run from no run."""
    assert resp.status_code == 404, resp.text
    assert resp.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "not_found"}
    }


@pytest.fixture
def two(make_proxy, stub):
    proxy = _proxy(make_proxy, stub)
    a = _key(proxy, "shop-agent", policies=["shop"])
    b = _key(proxy, "bank-agent", policies=["bank", "shop"])
    return proxy, a, b


def test_a_run_of_another_key_is_not_found_for_read_reward_or_judge(two):
    proxy, a, b = two
    assert _chat(proxy, a, "r1").status_code == 200
    assert _chat(proxy, a, "r2").status_code == 200
    run = httpx.get(f"{proxy.url}/v1/runs/r1", headers=a)
    assert run.status_code == 200 and run.json()["id"] == "r1", run.text
    assert run.json()["completions"][0]["run_id"] == "r1"
    # key B: read, reward, judge A's run -> the same 404 as a run nobody made
    _not_found(httpx.get(f"{proxy.url}/v1/runs/r1", headers=b), "run 'r1' not found")
    _not_found(
        httpx.post(f"{proxy.url}/v1/runs/r1/reward", json={"reward": 1.0}, headers=b), "run 'r1' not found"
    )
    _not_found(
        httpx.post(f"{proxy.url}/runs/r1/v1/reward", json={"reward": 1.0}, headers=b), "run 'r1' not found"
    )
    _not_found(httpx.post(f"{proxy.url}/v1/runs/r2/complete", json={}, headers=b), "run 'r2' not found")
    # nor can the shared agents' key reach an app's run
    _not_found(
        httpx.get(f"{proxy.url}/v1/runs/r1", headers={"Authorization": f"Bearer {AGENT}"}),
        "run 'r1' not found",
    )
    # A's runs are untouched and still A's to reward
    ok = httpx.post(f"{proxy.url}/v1/runs/r1/reward", json={"reward": 0.5}, headers=a)
    assert ok.status_code == 200 and ok.json() == {"run_id": "r1", "reward": 0.5, "stored": True}, ok.text
    rows = proxy.query("SELECT id, status, reward, key_id FROM runs ORDER BY id")
    key_a = proxy.query("SELECT id FROM keys WHERE name = 'shop-agent'")[0][0]
    assert rows == [(f"{key_a}~r1", "completed", 0.5, key_a), (f"{key_a}~r2", "open", None, key_a)]
    # the operator reads an app's run by its stored id
    admin = httpx.get(f"{proxy.url}/v1/runs/{key_a}~r1", headers={"Authorization": f"Bearer {ADMIN}"})
    assert admin.status_code == 200 and admin.json()["id"] == f"{key_a}~r1", admin.text


def test_a_turn_tagged_with_another_keys_run_id_never_joins_it(two):
    proxy, a, b = two
    assert _chat(proxy, a, "shared-name", group="g").status_code == 200
    assert _chat(proxy, b, "shared-name", group="g").status_code == 200  # B's own run of that name
    assert (
        httpx.post(f"{proxy.url}/v1/runs/shared-name/reward", json={"reward": 1}, headers=b).status_code
        == 200
    )
    # A's run is open, with its one turn; B's reward closed B's run only
    assert _chat(proxy, a, "shared-name").status_code == 200
    runs = proxy.query(
        "SELECT k.name, r.status, r.group_id, r.next_seq FROM runs r JOIN keys k ON k.id = r.key_id"
    )
    by = {name: (status, group, n) for name, status, group, n in runs}
    assert by["shop-agent"][0] == "open" and by["shop-agent"][2] == 2
    assert by["bank-agent"][0] == "completed" and by["bank-agent"][2] == 1
    assert by["shop-agent"][1] != by["bank-agent"][1]  # one X-Group-Id, two groups: no shared baseline
    # and the default group (no X-Group-Id, the same first prompt) is per key too
    assert _chat(proxy, a, "d1").status_code == 200 and _chat(proxy, b, "d2").status_code == 200
    groups = proxy.query("SELECT group_id FROM runs WHERE id LIKE '%~d_'")
    assert len({g for (g,) in groups}) == 2


def test_a_key_uses_only_its_policies(two):
    proxy, a, b = two
    refused = _chat(proxy, a, model="bank-model")
    assert refused.status_code == 404, refused.text
    err = refused.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "bank" not in err["message"][12:]
    assert _chat(proxy, a, model="bank@0").status_code == 404  # a pinned step of it too
    assert _chat(proxy, b, model="bank-model").status_code == 200
    # /v1/models lists only what the key may use (the stub serves `stub-model`: not A's)
    assert httpx.get(f"{proxy.url}/v1/models", headers=a).json()["data"] == []
    shared = httpx.get(f"{proxy.url}/v1/models", headers={"Authorization": f"Bearer {AGENT}"}).json()
    assert [m["id"] for m in shared["data"]] == ["stub-model"]
    metrics = httpx.get(f"{proxy.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert 'rlproxy_key_refusals_total{key="shop-agent",reason="model"} 2.0' in metrics
    assert 'rlproxy_key_requests_total{key="bank-agent"} 1.0' in metrics
    assert 'rlproxy_key_tokens_total{key="bank-agent"}' in metrics
    listed = httpx.get(f"{proxy.url}/v1/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    by = {k["name"]: k for k in listed["data"]}
    assert by["shop-agent"]["policies"] == ["shop"] and by["shop-agent"]["usage"]["refused"] == {"model": 2}
    assert by["bank-agent"]["usage"]["requests"] == 1 and "secret_hash" not in by["bank-agent"]
    assert httpx.get(f"{proxy.url}/v1/admin/keys", headers=a).status_code == 403


def test_reply_ids_are_per_key_and_a_repeated_one_is_409(two):
    proxy, a, b = two
    key_a = proxy.query("SELECT id FROM keys WHERE name = 'shop-agent'")[0][0]
    assert _chat(proxy, b).json()["id"] == "cmpl-stub"  # B's reply, older
    assert _chat(proxy, a).json()["id"] == "cmpl-stub"  # A's, the same id (the upstream repeats)
    # A's reward lands on A's reply, never on B's older one
    got = httpx.post(f"{proxy.url}/v1/completions/cmpl-stub/reward", json={"reward": 1.0}, headers=a)
    assert got.status_code == 200 and got.json()["run_id"] == "cmpl-stub", got.text
    assert proxy.query("SELECT run_id, key_id FROM completions WHERE run_id IS NOT NULL") == [
        (f"{key_a}~cmpl-stub", key_a)
    ]
    conflict = httpx.post(f"{proxy.url}/v1/completions/cmpl-stub/reward", json={"reward": 0.0}, headers=a)
    assert conflict.status_code == 409 and key_a not in conflict.text, conflict.text  # A's id, as A wrote it
    # B reads no run of that name (A's reply run is A's)
    _not_found(httpx.get(f"{proxy.url}/v1/runs/cmpl-stub", headers=b), "run 'cmpl-stub' not found")
    # B made two untagged calls with that id: ambiguous, 409, never one of them picked
    assert _chat(proxy, b).status_code == 200
    amb = httpx.post(f"{proxy.url}/v1/completions/cmpl-stub/reward", json={"reward": 1.0}, headers=b)
    assert amb.status_code == 409 and amb.json()["error"]["code"] == "reply_ambiguous", amb.text
    # a turn of B tagged with A's reply-run id is B's own run
    assert _chat(proxy, b, "cmpl-stub").status_code == 200
    assert proxy.query(f"SELECT count(*) FROM completions WHERE run_id = '{key_a}~cmpl-stub'") == [(1,)]


def test_responses_of_another_key_are_not_found(two):
    proxy, a, b = two
    made = httpx.post(
        f"{proxy.url}/v1/responses", json={"model": "shop-model", "input": "hi"}, headers=a, timeout=30
    )
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    assert httpx.get(f"{proxy.url}/v1/responses/{rid}", headers=a).status_code == 200
    theirs = httpx.get(f"{proxy.url}/v1/responses/{rid}", headers=b)
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "response_not_found"
    chained = httpx.post(
        f"{proxy.url}/v1/responses",
        json={"model": "shop-model", "input": "more", "previous_response_id": rid},
        headers=b,
        timeout=30,
    )
    assert chained.status_code == 404 and chained.json()["error"]["code"] == "previous_response_not_found"


def test_revoke_takes_effect_and_the_shared_key_works_as_before(two):
    proxy, a, _ = two
    shared = {"Authorization": f"Bearer {AGENT}"}
    assert _chat(proxy, shared, "s1").status_code == 200  # the one agents' key: as today
    assert httpx.post(f"{proxy.url}/v1/runs/s1/reward", json={"reward": 1}, headers=shared).status_code == 200
    assert proxy.query("SELECT id, key_id FROM runs WHERE id = 's1'") == [("s1", None)]
    assert _chat(proxy, {}).status_code == 401  # app keys or not: no key, no service
    assert httpx.get(f"{proxy.url}/v1/runs", headers=a).status_code == 403  # an operator route
    assert _chat(proxy, a).status_code == 200
    assert proxy.lt.run(keystore.revoke(proxy.state.engine, "shop-agent"))
    deadline = time.monotonic() + 5  # the ring reads the table every 2 s
    while _chat(proxy, a).status_code != 401:
        assert time.monotonic() < deadline, "a revoked key still served after 5 s"
        time.sleep(0.2)


def test_app_keys_alone_close_the_agent_routes(make_proxy, stub):
    proxy = make_proxy(stub.url, model_map=MAP)  # no RLPROXY_API_KEY, no admin key
    assert _chat(proxy, {}).status_code == 200  # open, as before
    a = _key(proxy, "solo")
    assert _chat(proxy, {}).status_code == 401
    assert _chat(proxy, {"x-api-key": a["Authorization"][7:]}).status_code == 200  # Anthropic's header


def test_limits_are_429_with_retry_after(make_proxy, stub):
    proxy = _proxy(make_proxy, stub)
    rpm = _key(proxy, "rpm", rpm=2)
    tpm = _key(proxy, "tpm", tpm=1)
    for _ in range(2):
        assert _chat(proxy, rpm).status_code == 200
    over = _chat(proxy, rpm)
    assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1, over.text
    assert over.json()["error"]["code"] == "rate_limit_exceeded"
    assert _chat(proxy, tpm).status_code == 200  # its usage counts once the call has ended
    again = _chat(proxy, tpm)
    assert again.status_code == 429 and "tokens per minute" in again.json()["error"]["message"], again.text
    metrics = httpx.get(f"{proxy.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert 'rlproxy_key_refusals_total{key="rpm",reason="rpm"} 1.0' in metrics
    assert 'rlproxy_key_refusals_total{key="tpm",reason="tpm"} 1.0' in metrics


def test_streams_in_flight_are_limited(make_proxy, stub):
    proxy = _proxy(make_proxy, stub)
    one = _key(proxy, "one-stream", max_streams=1)
    started = threading.Event()

    def hold() -> None:
        headers = {**one, "x-stub-delay": "1.5"}
        body = {"model": "shop-model", "messages": MSG, "stream": True}
        with httpx.stream(
            "POST", f"{proxy.url}/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as r:
            assert r.status_code == 200
            started.set()
            for _ in r.iter_bytes():
                pass

    t = threading.Thread(target=hold)
    t.start()
    assert started.wait(10)
    second = _chat(proxy, one, stream=True)
    assert second.status_code == 429 and second.headers["retry-after"] == "1", second.text
    assert _chat(proxy, one).status_code == 200  # a plain call is not a stream
    t.join()
    assert _chat(proxy, one, stream=True).status_code == 200  # the first one ended: room again
