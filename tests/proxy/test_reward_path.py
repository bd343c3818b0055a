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


# The paths the reward routes had as FastAPI routes (before HotPath served them, issue 24): the
# matcher must take exactly what Starlette's router took, and leave every other path to FastAPI.
OLD_ROUTES = [
    ("/v1/runs/{run_id}/complete", "complete"),
    ("/runs/{run_id}/v1/complete", "complete"),
    ("/runs/{run_id}/v1/runs/{named}/complete", "complete"),
    ("/v1/runs/{run_id}/reward", "reward"),
    ("/runs/{run_id}/v1/reward", "reward"),
    ("/runs/{run_id}/v1/runs/{named}/reward", "reward"),
]
PATHS = [
    "/v1/runs/a/reward",
    "/v1/runs/a/complete",
    "/runs/a/v1/reward",
    "/runs/a/v1/complete",
    "/runs/a/v1/runs/b/reward",
    "/runs/a/v1/runs/a/complete",
    "/v1/runs/a/reward/",
    "/v1/runs//reward",
    "/runs//v1/reward",
    "/runs/a/v1/runs//reward",
    "/v1/runs/a/b/reward",
    "/v1/runs/a/rewards",
    "/v1/runs/a",
    "/v1/runs/reward",
    "/runs/a/v2/reward",
    "/runs/v1/v1/reward",
    "/v1/runs/v1/reward",
    "/runs/a/v1/runs/b/c/reward",
    "/runs/a/v1/chat/completions",
    "/v1/chat/completions",
    "//v1/runs/a/reward",
    "/v1/runs/a b/reward",
    "/v1/runs/é/complete",
]


def test_the_reward_routes_match_what_fastapi_matched() -> None:
    from starlette.routing import Match, Route

    from rlproxy.proxy.routes_runs import reward_route

    async def endpoint(request):  # pragma: no cover - never called
        return None

    routes = [(Route(path, endpoint, methods=["POST"]), action) for path, action in OLD_ROUTES]
    for path in PATHS:
        want = None
        for route, action in routes:
            match, child = route.matches({"type": "http", "path": path, "method": "POST", "root_path": ""})
            if match == Match.FULL:
                params = child["path_params"]
                want = (params["run_id"], params.get("named"), action)
                break
        assert reward_route(path) == want, path
