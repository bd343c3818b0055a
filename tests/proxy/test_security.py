"""Security of the proxy: the two principals, engine routes, canonical paths, browsers, the engine key.

Issue 9's seen-cases pinned here: 2 (any agent could unload the served adapter; the engine's port had
no authentication), 3 (dot segments reached the engine's root routes; a trailing-slash chat route
was forwarded uncaptured and its 307 revealed the engine) and 5 (a text/plain POST from any web
page, a forged Host). Each test says which case it pins; each failed before the change.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from proxy_helpers import free_port

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
AGENT, ADMIN = "agent-key", "admin-key"


def _shape(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    """Assert OpenAI's error shape with `status` (and `code`); return the error object."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def _raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send `request` as it is (no client normalizes the path) and return (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- seen-case 2: engine-management routes and the two principals ---------------------------------


def test_engine_routes_are_never_forwarded(make_proxy, engine_backend, tiny_model_dir, lora_dir):
    """Case 2: `POST /v1/unload_lora_adapter` through the proxy unloaded the served adapter."""
    open_proxy = make_proxy(engine_backend.base_url, model=str(tiny_model_dir))
    keyed = make_proxy(engine_backend.base_url, model=str(tiny_model_dir), api_key=AGENT, admin_key=ADMIN)
    open_proxy.lt.run(engine_backend.load_adapter("tiny@1", str(lora_dir)))
    open_proxy.lt.run(open_proxy.state.policies.set_step("tiny", 1))  # what the trainer's publish does
    try:
        attempts = [
            (open_proxy, "/v1/unload_lora_adapter", {}),
            (open_proxy, "/v1/unload_lora_adapter/", {}),
            (open_proxy, "/runs/r-1/v1/unload_lora_adapter", {}),
            (keyed, "/v1/unload_lora_adapter", _auth(AGENT)),
            (keyed, "/v1/unload_lora_adapter", _auth(ADMIN)),  # not even the operator
        ]
        for proxy, path, headers in attempts:
            resp = httpx.post(f"{proxy.url}{path}", json={"lora_name": "tiny@1"}, headers=headers)
            _shape(resp, 403, "engine_route_forbidden")
        load = {"lora_name": "tiny@1", "lora_path": "/etc", "load_inplace": True}
        _shape(httpx.post(f"{open_proxy.url}/v1/load_lora_adapter", json=load), 403, "engine_route_forbidden")
        # the adapter is still served (before, every chat call after the unload was 404)
        answer = httpx.post(
            f"{open_proxy.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=120,
        )
        assert answer.status_code == 200 and answer.headers["x-policy-step"] == "1", answer.text
    finally:
        open_proxy.lt.run(engine_backend.unload_adapter("tiny@1"))


def test_agent_key_cannot_list_runs_admin_key_can(make_proxy, stub):
    """Case 2 (principals): an agent's key read every run; now listing is the operator's."""
    proxy = make_proxy(stub.url, api_key=AGENT, admin_key=ADMIN)
    chat = httpx.post(
        f"{proxy.url}/v1/chat/completions", json=CHAT, headers={**_auth(AGENT), "X-Run-Id": "a1"}
    )
    assert chat.status_code == 200
    reward = httpx.post(f"{proxy.url}/v1/runs/a1/reward", json={"reward": 1.0}, headers=_auth(AGENT))
    assert reward.status_code == 200
    assert httpx.get(f"{proxy.url}/v1/runs/a1", headers=_auth(AGENT)).status_code == 200  # its own run
    operator_routes = ["/v1/runs", "/v1/runs/stats", "/v1/training/steps", "/metrics"]
    for path in operator_routes:
        _shape(httpx.get(f"{proxy.url}{path}", headers=_auth(AGENT)), 403, "admin_key_required")
        _shape(httpx.get(f"{proxy.url}{path}"), 401, "invalid_api_key")
        assert httpx.get(f"{proxy.url}{path}", headers=_auth(ADMIN)).status_code == 200, path
    assert [r["id"] for r in httpx.get(f"{proxy.url}/v1/runs", headers=_auth(ADMIN)).json()["data"]] == ["a1"]
    # the operator may do what agents do
    admin = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=ADMIN, max_retries=0)
    assert admin.chat.completions.create(**CHAT).choices[0].message.content
    _shape(httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT), 401, "invalid_api_key")
    assert httpx.get(f"{proxy.url}/healthz").status_code == 200  # public


def test_only_the_agent_key_closes_operator_routes(make_proxy, stub):
    """Case 2: with only RLPROXY_API_KEY set, operator routes say to set RLPROXY_ADMIN_KEY."""
    proxy = make_proxy(stub.url, api_key=AGENT)
    error = _shape(httpx.get(f"{proxy.url}/v1/runs", headers=_auth(AGENT)), 403, "admin_key_required")
    assert "RLPROXY_ADMIN_KEY" in error["message"]
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=_auth(AGENT)).status_code == 200


def test_only_the_admin_key_keeps_agent_routes_open(make_proxy, stub):
    proxy = make_proxy(stub.url, admin_key=ADMIN)
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT).status_code == 200
    _shape(httpx.get(f"{proxy.url}/v1/runs"), 401, "invalid_api_key")
    assert httpx.get(f"{proxy.url}/v1/runs", headers=_auth(ADMIN)).status_code == 200


def test_equal_keys_are_refused():
    from rlproxy.errors import ConfigError
    from rlproxy.proxy.auth import Principals

    with pytest.raises(ConfigError, match="must differ"):
        Principals("same", "same")


# --- seen-case 2: the proxy->engine hop carries a secret ----------------------------------------


@pytest.fixture
def keyed_engine(engine_backend, loop_thread) -> Any:
    """The session's engine behind a second loopback server that requires the key `engine-secret`."""
    import asyncio

    import uvicorn

    from rlproxy.inference.server import create_engine_app

    port = free_port()
    app = create_engine_app(engine_backend.engine, api_key="engine-secret")
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )

    async def start() -> asyncio.Task:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        return task

    task = loop_thread.run(start())
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True

    async def wait() -> None:
        await asyncio.wait_for(task, 10)

    loop_thread.run(wait())


def test_engine_requires_its_secret(keyed_engine, make_proxy, engine_backend, tiny_model_dir):
    """Case 2: the engine's loopback port answered anyone; now only holders of the secret."""
    from rlproxy.inference.vllm import VLLMBackend

    assert httpx.get(f"{keyed_engine}/health").status_code == 200  # health stays open
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/unload_lora_adapter"),
    ):
        resp = httpx.request(method, f"{keyed_engine}{path}", json={"lora_name": "x"})
        assert resp.status_code == 401 and resp.json() == {"error": "Unauthorized"}
        assert httpx.request(method, f"{keyed_engine}{path}", headers=_auth("wrong")).status_code == 401
    assert httpx.get(f"{keyed_engine}/v1/models", headers=_auth("engine-secret")).status_code == 200
    # the proxy sends the secret; the client's own Authorization never reaches the engine
    backend = VLLMBackend(str(tiny_model_dir), upstream=keyed_engine, api_key="engine-secret")
    proxy = make_proxy(keyed_engine, model=str(tiny_model_dir), backend=backend)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="the-clients-own", max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_headers={"X-Run-Id": "k1"},
    )
    assert chat.choices[0].message.content is not None
    assert [m.id for m in client.models.list().data][0] == "tiny"  # the pass-through sends it too
    assert proxy.query("SELECT run_id, status FROM completions") == [("k1", "ok")]


def test_composition_root_makes_a_secret_per_process():
    """Case 2: `make_backend` gives every engine it starts a fresh random key; attach uses the setting."""
    from rlproxy.compose import make_backend
    from rlproxy.settings import Settings

    one, two = make_backend(Settings(model="tiny")), make_backend(Settings(model="tiny"))
    assert one.api_key and two.api_key and one.api_key != two.api_key and len(one.api_key) >= 32
    launched = make_backend(Settings(model="tiny", backend="vllm"))
    assert launched.api_key and launched.environment()["VLLM_API_KEY"] == launched.api_key
    assert launched.api_key not in " ".join(launched.command("/m", 1234))  # not on the command line
    attached = make_backend(Settings(model="tiny", upstream="http://h:1", upstream_api_key="up"))
    assert attached.api_key == "up"
    assert make_backend(Settings(model="tiny", upstream="http://h:1")).api_key is None


# --- seen-case 3: only canonical paths ----------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        b"/v1/../health",
        b"/v1/%2e%2e/health",
        b"/v1/%2E%2e/healthz",
        b"/v1/./models",
        b"/v1/..",
        b"/v1//models",
        b"/v1/runs%2fstats",
        b"/v1/%252e%252e/health",
        b"/runs/r/v1/../../health",
    ],
)
def test_non_canonical_paths_are_refused(make_proxy, stub, target):
    """Case 3: `/v1/../health` and `/v1/%2e%2e/health` reached the engine's root routes."""
    proxy = make_proxy(stub.url)
    request = b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" % target
    status, body = _raw(proxy.url, request)
    assert status == 400, body
    assert orjson.loads(body)["error"]["code"] == "invalid_path"


def test_path_problem_unit():
    from rlproxy.proxy.guard import path_problem

    for good in (b"/", b"/v1/chat/completions", b"/v1/runs/a.b:c-1/reward", b"/.well-known/x", b"/v1/a..b"):
        assert path_problem(good) is None, good
    for bad in (b"/v1\\..\\health", b"/v1/%5chealth", b"/v1/%00", b"*", b"http://x/v1/models", b"/a/."):
        assert path_problem(bad) is not None, bad


def test_trailing_slash_chat_route_is_captured(make_proxy, stub):
    """Case 3: `POST /v1/chat/completions/` was forwarded uncaptured (a 307 to the engine)."""
    proxy = make_proxy(stub.url)
    for path, run in (
        ("/v1/chat/completions/", "slash-1"),
        ("/runs/slash-2/v1/chat/completions/", "slash-2"),
    ):
        resp = httpx.post(f"{proxy.url}{path}", json=CHAT, headers={"X-Run-Id": run})
        assert resp.status_code == 200 and resp.headers["x-policy-step"] == "0", resp.text
        assert "location" not in resp.headers
    assert sorted(proxy.query("SELECT run_id, status FROM completions")) == [
        ("slash-1", "ok"),
        ("slash-2", "ok"),
    ]
    _shape(httpx.get(f"{proxy.url}/healthz/"), 404)  # no redirect_slashes: 404, never a 307


def _redirecting_stub() -> Any:
    """The stub upstream, plus a 307 to its own address for `/v1/models/` (as vLLM's FastAPI does)."""
    from stub_upstream import StubUpstream

    class Redirecting(StubUpstream):
        async def _handle(self, method, path, body, delay, w) -> None:
            if path != b"/v1/models/":
                await super()._handle(method, path, body, delay, w)
                return
            w.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: %s/v1/models\r\n" % self.url.encode())
            w.write(b"content-length: 0\r\n\r\n")
            await w.drain()

    return Redirecting()


def test_upstream_redirects_are_never_relayed(make_proxy, loop_thread):
    """Case 3: the engine's 307 revealed its internal address to the client."""
    stub = _redirecting_stub()
    loop_thread.run(stub.start())
    try:
        proxy = make_proxy(stub.url)
        resp = httpx.get(f"{proxy.url}/v1/models/")
        _shape(resp, 502, "upstream_redirect")
        assert "location" not in resp.headers and stub.url.split("//")[1] not in resp.text
        assert httpx.get(f"{proxy.url}/v1/models").status_code == 200  # the connection went back fine
        assert stub.url.split("//")[1] not in httpx.get(f"{proxy.url}/healthz").text  # public: no address
    finally:
        loop_thread.run(stub.stop())


# --- seen-case 5: browsers are not agents ------------------------------------------------------


def test_non_json_posts_are_refused(make_proxy, stub):
    """Case 5: a `text/plain` POST (no CORS preflight) from any web page was served and stored."""
    proxy = make_proxy(stub.url)
    body = orjson.dumps(CHAT)
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"X-Run-Id": "csrf"} | ({"Content-Type": ctype} if ctype else {})
        _shape(
            httpx.post(f"{proxy.url}/v1/chat/completions", content=body, headers=headers),
            415,
            "unsupported_media_type",
        )
    reward = httpx.post(
        f"{proxy.url}/v1/runs/csrf/reward", content=b'{"reward": 1}', headers={"Content-Type": "text/plain"}
    )
    _shape(reward, 415)
    assert proxy.query("SELECT count(*) FROM completions") == [(0,)]
    ok = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        content=body,
        headers={"Content-Type": "Application/JSON; charset=utf-8"},
    )
    assert ok.status_code == 200


def test_cross_origin_browser_requests_are_refused(make_proxy, stub):
    """Case 5: with no key, any web page the operator opened could call the proxy."""
    proxy = make_proxy(stub.url)
    evil = {"Origin": "http://evil.example"}
    _shape(
        httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=evil), 403, "cross_origin_refused"
    )
    _shape(httpx.get(f"{proxy.url}/v1/runs", headers=evil), 403, "cross_origin_refused")
    preflight = {**evil, "Access-Control-Request-Method": "POST"}
    resp = httpx.options(f"{proxy.url}/v1/chat/completions", headers=preflight)
    assert resp.status_code == 403 and "access-control-allow-origin" not in resp.headers
    _shape(httpx.get(f"{proxy.url}/v1/runs", headers={"Sec-Fetch-Site": "cross-site"}), 403)
    same = {"Origin": proxy.url, "Sec-Fetch-Site": "same-origin"}  # the dashboard's own page
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=same).status_code == 200
    assert proxy.query("SELECT count(*) FROM completions") == [(1,)]


def test_configured_origins_get_cors(make_proxy, stub):
    proxy = make_proxy(stub.url, cors_origins="http://app.example, http://other.example", api_key=AGENT)
    origin = {"Origin": "http://app.example"}
    pre = httpx.options(
        f"{proxy.url}/v1/chat/completions",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-run-id",
        },
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
    assert "x-run-id" in pre.headers["access-control-allow-headers"].lower()
    resp = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={**origin, **_auth(AGENT)})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "http://app.example"
    refused = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=origin)  # no key
    assert (
        refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "http://app.example"
    )
    _shape(
        httpx.get(f"{proxy.url}/v1/models", headers={"Origin": "http://evil.example", **_auth(AGENT)}), 403
    )


def test_forged_host_is_refused(make_proxy, stub):
    """Case 5: a forged Host (DNS rebinding) read `/v1/runs` of a loopback proxy."""
    proxy = make_proxy(stub.url)
    _shape(httpx.get(f"{proxy.url}/v1/runs", headers={"Host": "evil.example:8000"}), 421, "invalid_host")
    _shape(httpx.get(f"{proxy.url}/v1/runs", headers={"Host": "127.0.0.1.evil.example"}), 421, "invalid_host")
    for host in (f"localhost:{proxy.port}", f"127.0.0.1:{proxy.port}", f"[::1]:{proxy.port}", "LOCALHOST"):
        assert httpx.get(f"{proxy.url}/v1/runs", headers={"Host": host}).status_code == 200, host
    status, _ = _raw(proxy.url, b"GET /v1/runs HTTP/1.0\r\n\r\n")  # no Host at all
    assert status == 421
    named = make_proxy(stub.url, allowed_hosts="proxy.internal")
    assert httpx.get(f"{named.url}/v1/runs", headers={"Host": "proxy.internal:80"}).status_code == 200
    _shape(httpx.get(f"{named.url}/v1/runs"), 421)
    anywhere = make_proxy(stub.url, host="0.0.0.0")  # bound beyond loopback: any Host unless configured
    assert httpx.get(f"{anywhere.url}/v1/runs", headers={"Host": "proxy.example"}).status_code == 200


def test_allowed_host_names_unit():
    from rlproxy.proxy.guard import LOOPBACK_HOSTS, allowed_host_names, host_name

    assert allowed_host_names("", "127.0.0.1") == LOOPBACK_HOSTS == allowed_host_names("", "::1")
    assert allowed_host_names("", "localhost") == LOOPBACK_HOSTS
    assert allowed_host_names("", "0.0.0.0") is None and allowed_host_names("*", "127.0.0.1") is None
    assert allowed_host_names("A.example, b.example:8000", "0.0.0.0") == {b"a.example", b"b.example"}
    assert host_name(b"[::1]:80") == b"[::1]" and host_name(b"Example.COM:1") == b"example.com"


def test_engine_command_takes_a_key(tiny_model_dir):
    """Case 2: `rlproxy engine --api-key K` answers only requests that carry K (health aside)."""
    import subprocess
    import sys
    import time

    port = free_port()
    rlproxy = str(Path(sys.executable).parent / "rlproxy")
    cmd = [rlproxy, "engine", "--model", str(tiny_model_dir)]
    cmd += ["--port", str(port), "--threads", "1", "--api-key", "engine-k"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=_auth("engine-k")).json()["data"][0]["id"] == "tiny"
    finally:
        proc.terminate()
        proc.wait(30)
