"""Run queries, health, metrics, the API key and the training hold gate."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}


def _post(proxy, run_id: str | None = None, group: str | None = None, **extra) -> httpx.Response:
    headers = {}
    if run_id:
        headers["X-Run-Id"] = run_id
    if group:
        headers["X-Group-Id"] = group
    return httpx.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, **extra}, headers=headers)


def _until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_runs_queries_and_groups(make_proxy, stub):
    proxy = make_proxy(stub.url)
    for i in range(3):
        _post(proxy, f"same-task-{i}")  # same policy+prompt: one default group
    _post(proxy, "other", messages=[{"role": "user", "content": "something else"}])
    _post(proxy, "explicit", group="g1")
    _post(proxy, "same-task-0")
    httpx.post(f"{proxy.url}/v1/runs/same-task-0/reward", json={"reward": 1, "metadata": {"k": "v"}})
    groups = dict(proxy.query("SELECT id, group_id FROM runs"))
    assert groups["same-task-0"] == groups["same-task-1"] == groups["same-task-2"] != groups["other"]
    assert groups["explicit"] == "g1"

    page = httpx.get(f"{proxy.url}/v1/runs", params={"limit": 2}).json()
    assert page["object"] == "list" and len(page["data"]) == 2 and page["next_cursor"]
    rest = httpx.get(f"{proxy.url}/v1/runs", params={"limit": 10, "cursor": page["next_cursor"]}).json()
    assert len(page["data"]) + len(rest["data"]) == 5
    done = httpx.get(f"{proxy.url}/v1/runs", params={"status": "completed"}).json()["data"]
    assert [r["id"] for r in done] == ["same-task-0"]
    assert len(httpx.get(f"{proxy.url}/v1/runs", params={"group_id": "g1"}).json()["data"]) == 1

    run = httpx.get(f"{proxy.url}/v1/runs/same-task-0").json()
    assert run["reward"] == 1.0 and [c["seq"] for c in run["completions"]] == [0, 1]
    assert httpx.get(f"{proxy.url}/v1/runs/nope").status_code == 404
    steps = httpx.get(f"{proxy.url}/v1/training/steps").json()
    assert steps["object"] == "list" and steps["data"] == []


def test_healthz_and_metrics(make_proxy, stub):
    proxy = make_proxy(stub.url)
    health = httpx.get(f"{proxy.url}/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    _post(proxy, "m1")
    _post(proxy, "m1", stream=True)
    _post(proxy, "m1", model="nope")
    proxy.flush()
    text = httpx.get(f"{proxy.url}/metrics").text
    assert 'rlproxy_requests_total{endpoint="chat.completions",status="ok"} 2.0' in text
    assert "rlproxy_request_latency_seconds_bucket" in text
    assert 'rlproxy_ttft_seconds_count{endpoint="chat.completions"} 1.0' in text
    assert "rlproxy_captured_rows_total 2.0" in text
    assert "rlproxy_write_queue_depth 0.0" in text
    assert "rlproxy_write_errors_total 0.0" in text
    commits = re.search(r"^rlproxy_write_commits_total (\S+)$", text, re.M)
    assert commits and 1 <= float(commits.group(1)) <= 2  # the two rows, in one or two transactions
    assert "rlproxy_late_turns_total 0.0" in text  # present only once RunState is attached


def test_api_key(make_proxy, stub):
    proxy = make_proxy(stub.url, api_key="s3cret")
    assert httpx.get(f"{proxy.url}/healthz").status_code == 200  # open
    for path in ("/v1/models", "/v1/runs", "/metrics"):
        resp = httpx.get(f"{proxy.url}{path}")
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert _post(proxy).status_code == 401
    bad = httpx.get(f"{proxy.url}/v1/runs", headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="s3cret", max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="nope", max_retries=0).models.list()


def test_blocking_train_holds_requests(make_proxy, stub):
    proxy = make_proxy(stub.url, blocking_train=True)
    gate = proxy.state.gate
    gate.set_training(True)  # from this (non-loop) thread, as a trainer thread would
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("r", _post(proxy, "held")))
    t.start()
    time.sleep(0.5)
    assert "r" not in result  # held, not failed
    gate.set_training(False)
    t.join(5)
    assert result["r"].status_code == 200


def test_unrewarded_runs_expire(make_proxy, stub):
    proxy = make_proxy(stub.url, run_expiry=0.2)
    _post(proxy, "forgotten")
    deadline = time.monotonic() + 8
    status = None
    while time.monotonic() < deadline and status != "expired":
        time.sleep(0.3)
        ((status,),) = proxy.query("SELECT status FROM runs WHERE id = 'forgotten'")
    assert status == "expired"


def test_build_app_wires_the_trainer(loop_thread, stub, tmp_path):
    """build_app: the trainer's on_publish flips the policy step, on_train_state drives the hold gate."""
    from proxy_helpers import ProxyServer

    from rlproxy.compose import build_app
    from rlproxy.inference.vllm import VLLMBackend
    from rlproxy.settings import Settings
    from rlproxy.trainer.service import TrainerService

    db = tmp_path / "wired.db"
    settings = Settings(db_url=str(db), train=True, blocking_train=True, model="stub-model", poll_interval=30)
    app = build_app(settings, backend=VLLMBackend("stub-model", upstream=stub.url))
    (service,) = app.state.proxy.services
    assert isinstance(service, TrainerService)
    server = ProxyServer(loop_thread, app, db).start()
    try:
        loop_thread.run(service.on_publish("stub-model", 4))
        assert _post(server).headers["x-policy-step"] == "4"
        gate = app.state.proxy.gate
        service.on_train_state(True)  # from a non-loop thread: applied on the loop shortly after
        assert _until(lambda: not gate.is_open)
        service.on_train_state(False)
        assert _until(lambda: gate.is_open)
    finally:
        server.stop()
