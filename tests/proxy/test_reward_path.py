"""The reward under a path-form base URL (`OPENAI_BASE_URL=http://host/runs/{id}/v1`).

Contract (rlproxy/proxy/routes_runs.py): `$OPENAI_BASE_URL/reward` is "this run"
(`POST /runs/{id}/v1/reward`); `$OPENAI_BASE_URL/runs/{id}/reward` works when both ids agree and
is 400 `run_id_mismatch` when they differ. Neither is ever relayed to the upstream. Driven with the
real OpenAI SDK for the completions and the real curl for the rewards, with and without a key.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import openai
import pytest
from support import require

KEY = "sk-agents-key"


def _curl(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    require(shutil.which("curl"), "needs the curl program: apt-get install curl")
    cmd = ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", url, "-H", "Content-Type: application/json"]
    if key:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    out = subprocess.run([*cmd, "-d", json.dumps(body)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text, _, status = out.stdout.rpartition("\n")
    return int(status), json.loads(text)


@pytest.mark.parametrize("key", [None, KEY], ids=["open", "key"])
def test_path_form_reward_routes(make_proxy, stub, key):
    proxy = make_proxy(stub.url, api_key=key)
    base = f"{proxy.url}/runs/ep-1/v1"
    client = openai.OpenAI(base_url=base, api_key=key or "none", max_retries=0)
    client.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}])
    relayed = stub.requests

    if key:  # the reward needs the agents' key like every agent route
        status, body = _curl(f"{base}/reward", {"reward": 0.5})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert _curl(f"{base}/reward", {"reward": 0.5}, key) == (
        200,
        {"run_id": "ep-1", "reward": 0.5, "stored": True},
    )
    # the natural form, $OPENAI_BASE_URL/runs/ep-1/reward, is the same run: the same reward again is 200
    assert _curl(f"{base}/runs/ep-1/reward", {"reward": 0.5}, key) == (
        200,
        {"run_id": "ep-1", "reward": 0.5, "stored": False},
    )
    status, body = _curl(f"{base}/runs/ep-1/reward", {"reward": 1.0}, key)
    assert status == 409 and body["error"]["code"] == "conflict"
    status, body = _curl(f"{base}/runs/ep-2/reward", {"reward": 1.0}, key)
    assert status == 400 and body["error"]["code"] == "run_id_mismatch"
    assert "/runs/ep-1/v1/reward" in body["error"]["message"]
    status, body = _curl(f"{proxy.url}/runs/nope/v1/reward", {"reward": 1.0}, key)
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = _curl(f"{base}/reward", {"reward": "high"}, key)
    assert status == 422 and body["error"]["param"] == "reward"
    status, body = _curl(f"{proxy.url}/runs/bad%20id/v1/reward", {"reward": 1.0}, key)
    assert status == 400

    assert stub.requests == relayed, "a reward route was relayed to the upstream"
    assert proxy.query("SELECT id, reward, status FROM runs") == [("ep-1", 0.5, "completed")]


def test_path_form_reward_body_limit(make_proxy, stub):
    """The reward routes under the run prefix keep the reward body bound (max_reward_body_bytes)."""
    proxy = make_proxy(stub.url, max_reward_body_bytes=1024)
    httpx.post(
        f"{proxy.url}/runs/ep-1/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    big = {"reward": 1.0, "metadata": {"pad": "x" * 4096}}
    for path in ("/runs/ep-1/v1/reward", "/runs/ep-1/v1/runs/ep-1/reward"):
        assert httpx.post(proxy.url + path, json=big).status_code == 413
