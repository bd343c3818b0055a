"""Policy routing: default policy, model map, pinning, steps from set_step, the poll and a restart."""

from __future__ import annotations

import sqlite3
import time

import httpx
import openai
import pytest

from rlproxy.errors import APIError
from rlproxy.proxy.policies import Policies, parse_model_map

MESSAGES = [{"role": "user", "content": "hi"}]


def test_resolve_rules():
    p = Policies("base", "gpt-4o-mini=agent,other=base")
    assert p.resolve(None) == ("base", 0, "base")
    assert p.resolve("base") == ("base", 0, "base")
    assert p.resolve("gpt-4o-mini") == ("agent", 0, "base")  # a new policy starts on the base model
    assert p.resolve("other") == ("base", 0, "base")
    p.advance({"agent": (3, "/ckpt/agent/3"), "base": (1, "/ckpt/base/1")})
    assert p.resolve("gpt-4o-mini") == ("agent", 3, "agent@3")
    assert p.resolve("base") == ("base", 1, "base@1")
    assert p.resolve("agent@2") == ("agent", 2, "agent@2")  # pinned
    assert p.resolve("agent@0") == ("agent", 0, "base")
    with pytest.raises(APIError) as exc:
        p.resolve("gpt-5")
    assert exc.value.status == 404 and "RLPROXY_MODEL_MAP" in exc.value.message
    with pytest.raises(APIError):
        p.resolve("nobody@1")
    p.advance({"agent": (2, "/old")})  # never moves backwards
    assert p.step("agent") == 3


def test_wildcard_map():
    p = Policies("base", "*=agent")
    assert p.resolve("anything")[0] == "agent"
    assert p.resolve("base")[0] == "base"


def test_bad_model_map():
    with pytest.raises(ValueError):
        parse_model_map("oops")


def _chat(proxy, model: str, **headers: str):
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=4, seed=1, extra_headers=headers or None
    )


def test_set_step_routes_to_the_adapter(make_proxy, engine_backend, tiny_model_dir, lora_dir, loop_thread):
    proxy = make_proxy(engine_backend.base_url, model=str(tiny_model_dir), model_map="gpt-4o-mini=tiny")
    before = _chat(proxy, "gpt-4o-mini")
    assert before.headers["x-policy-step"] == "0" and before.parse().model == "tiny"
    loop_thread.run(engine_backend.load_adapter("tiny@1", str(lora_dir)))
    loop_thread.run(proxy.state.policies.set_step("tiny", 1))
    after = _chat(proxy, "gpt-4o-mini", **{"X-Run-Id": "p1"})
    assert after.headers["x-policy-step"] == "1" and after.parse().model == "tiny@1"
    pinned = _chat(proxy, "tiny@0")
    assert pinned.headers["x-policy-step"] == "0" and pinned.parse().model == "tiny"
    ((policy, adapter, step),) = proxy.query(
        "SELECT policy, adapter, policy_step FROM completions WHERE run_id='p1'"
    )
    assert (policy, adapter, step) == ("tiny", "tiny@1", 1)
    assert 'rlproxy_policy_step{policy="tiny"} 1.0' in httpx.get(f"{proxy.url}/metrics").text


def test_steps_published_by_another_process_and_restart(make_proxy, engine_backend, tiny_model_dir, lora_dir):
    proxy = make_proxy(engine_backend.base_url, model=str(tiny_model_dir))
    # a separate `rlproxy train` process loads the adapter into the server and commits the step
    con = sqlite3.connect(proxy.db_path)
    with con:
        con.execute(
            "INSERT INTO training_steps (step, policy, adapter_path) VALUES (2, 'tiny', ?)", (str(lora_dir),)
        )
    con.close()
    proxy.lt.run(engine_backend.load_adapter("tiny@2", str(lora_dir)))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and proxy.state.policies.step("tiny") != 2:
        time.sleep(0.1)
    assert _chat(proxy, "tiny").headers["x-policy-step"] == "2"
    # a restarted proxy on the same database re-loads the newest adapter and serves it at once
    proxy.lt.run(engine_backend.unload_adapter("tiny@2"))
    proxy.stop()
    from proxy_helpers import ProxyServer

    from rlproxy.compose import build_app
    from rlproxy.inference.vllm import VLLMBackend
    from rlproxy.settings import Settings

    settings = Settings(db_url=f"sqlite+aiosqlite:///{proxy.db_path}", train=False, model=str(tiny_model_dir))
    backend = VLLMBackend(str(tiny_model_dir), upstream=engine_backend.base_url)
    again = ProxyServer(proxy.lt, build_app(settings, backend), proxy.db_path).start()
    try:
        assert again.state.policies.step("tiny") == 2
        resp = _chat(again, "tiny")
        assert resp.headers["x-policy-step"] == "2" and resp.parse().model == "tiny@2"
    finally:
        again.stop()
