"""Every bad input from the issue, each its own test: status code and OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


@pytest.fixture
def proxy(make_proxy, stub):
    return make_proxy(stub.url, max_body_bytes=4096, upstream_timeout=1.0)


def test_malformed_json_is_400(proxy):
    resp = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        content=b'{"model": "stub-model", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert _error(resp, 400)["code"] == "invalid_json"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "stub-model", "messages": "hi"}, "messages"),
        ({"model": "stub-model"}, "messages"),
        ({"model": 5, "messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "n": "2"}, "n"),
        ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "tools": {"type": "function"}}, "tools"),
    ],
)
def test_wrong_types_are_422(proxy, body, param):
    err = _error(httpx.post(f"{proxy.url}/v1/chat/completions", json=body), 422)
    assert err["param"] == param


def test_json_that_is_not_an_object_is_422(proxy):
    _error(httpx.post(f"{proxy.url}/v1/chat/completions", json=[1, 2]), 422)


def test_completions_prompt_type_is_422(proxy):
    err = _error(httpx.post(f"{proxy.url}/v1/completions", json={"model": "stub-model", "prompt": 3}), 422)
    assert err["param"] == "prompt"


@pytest.mark.parametrize("run_id", [b"has space", b"x" * 129, b"back\\slash", "é".encode(), b""])
def test_bad_run_id_header_is_400(proxy, run_id):
    resp = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={b"X-Run-Id": run_id})
    assert _error(resp, 400)["code"] == "invalid_run_id"


def test_bad_run_id_in_path_is_400(proxy):
    _error(httpx.post(f"{proxy.url}/runs/bad%20id/v1/chat/completions", json=CHAT), 400)


def test_bad_group_id_is_400(proxy):
    _error(httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={"X-Group-Id": "a b"}), 400)


def test_body_over_limit_is_413(proxy):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    _error(httpx.post(f"{proxy.url}/v1/chat/completions", json=big), 413)


def test_body_over_limit_without_content_length_is_413(proxy):
    def chunks():
        yield b'{"model": "stub-model", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    json_type = {"content-type": "application/json"}
    _error(httpx.post(f"{proxy.url}/v1/chat/completions", content=chunks(), headers=json_type), 413)


def test_unknown_model_is_404_with_a_hint(proxy):
    err = _error(httpx.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, "model": "gpt-4o-mini"}), 404)
    assert err["code"] == "model_not_found" and "RLPROXY_MODEL_MAP" in err["message"]


def _one_completion(proxy, run_id: str) -> None:
    resp = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={"X-Run-Id": run_id})
    assert resp.status_code == 200


def test_reward_unknown_run_is_404(proxy):
    _error(httpx.post(f"{proxy.url}/v1/runs/nobody/reward", json={"reward": 1.0}), 404)


@pytest.mark.parametrize(
    "body",
    [
        b'{"reward": NaN}',
        b'{"reward": Infinity}',
        b'{"reward": -Infinity}',
        b"{}",
        b'{"reward": "1"}',
        b'{"reward": null}',
        b'{"reward": 1e999}',
        b'{"reward": true}',
        b'{"reward": 1, "metrics": {"a": "x"}}',
    ],
)
def test_reward_missing_or_non_finite_is_422(proxy, body):
    _one_completion(proxy, "r422")
    json_type = {"content-type": "application/json"}  # else 415 (tests/proxy/test_security.py)
    _error(httpx.post(f"{proxy.url}/v1/runs/r422/reward", content=body, headers=json_type), 422)


def test_reward_conflict_409_and_same_again_200(proxy):
    _one_completion(proxy, "r1")
    first = httpx.post(f"{proxy.url}/v1/runs/r1/reward", json={"reward": 0.5, "metrics": {"steps": 3}})
    assert first.status_code == 200 and first.json()["stored"] is True
    again = httpx.post(f"{proxy.url}/v1/runs/r1/reward", json={"reward": 0.5, "metrics": {"steps": 3}})
    assert again.status_code == 200 and again.json()["stored"] is False
    _error(httpx.post(f"{proxy.url}/v1/runs/r1/reward", json={"reward": 0.7}), 409)
    assert proxy.query("SELECT reward, status FROM runs WHERE id = 'r1'") == [(0.5, "completed")]


def test_upstream_refused_is_502_and_stored(make_proxy, stub, loop_thread):
    proxy = make_proxy(stub.url)
    loop_thread.run(stub.stop())  # the upstream goes away after the proxy attached
    resp = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={"X-Run-Id": "down"})
    assert _error(resp, 502)["code"] == "upstream_unavailable"
    ((status, code, error),) = proxy.query(
        "SELECT status, status_code, error FROM completions WHERE run_id = 'down'"
    )
    assert (status, code) == ("error", 502) and "unreachable" in error
    # the proxy stays up
    assert httpx.get(f"{proxy.url}/healthz").status_code == 503
    resp = httpx.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, "stream": True})
    _error(resp, 502)


def test_upstream_timeout_is_504_and_stored(proxy, stub):
    resp = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=CHAT,
        headers={"X-Run-Id": "slow", "x-stub-delay": "3"},
        timeout=10,
    )
    assert _error(resp, 504)["code"] == "upstream_timeout"
    ((status, code, error, latency),) = proxy.query(
        "SELECT status, status_code, error, latency_ms FROM completions WHERE run_id = 'slow'"
    )
    assert (status, code) == ("error", 504) and "did not answer" in error and latency >= 1000
    # the proxy stays up and serves the next request
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT).status_code == 200


def test_upstream_error_status_is_passed_through_and_stored(proxy):
    resp = httpx.post(f"{proxy.url}/v1/chat/completions/nope", json=CHAT)
    assert resp.status_code == 404  # a pass-through path the stub does not know
    resp = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={**CHAT, "model": "stub-model@9"},
        headers={"X-Run-Id": "pinned-missing"},
    )
    assert resp.status_code == 200  # the stub serves any model name; the request was pinned
    ((adapter, step),) = proxy.query(
        "SELECT adapter, policy_step FROM completions WHERE run_id = 'pinned-missing'"
    )
    assert (adapter, step) == ("stub-model@9", 9)


def test_upstream_restart_is_survived(make_proxy, loop_thread):
    """Pooled keep-alive connections to an upstream that restarted are dropped, not used."""
    from stub_upstream import StubUpstream

    first = StubUpstream()
    loop_thread.run(first.start())
    proxy = make_proxy(first.url)
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT).status_code == 200
    loop_thread.run(first.stop())
    second = StubUpstream(port=first.port)
    loop_thread.run(second.start())
    try:
        for _ in range(3):
            assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        loop_thread.run(second.stop())
