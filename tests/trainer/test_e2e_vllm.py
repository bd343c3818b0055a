"""End to end on the real vLLM: after one step the adapter `{policy}@1` is loaded in vLLM and serves
the app's next request.

`build_app` (what `rlproxy serve --backend vllm --upstream URL` runs) attached to the session's vLLM
server (`vllm_backend` in tests/conftest.py, the tiny model), trainer on, under a real uvicorn server;
the app is the `openai` SDK with `X-Run-Id`, rewards go over HTTP. One group of 4 runs with varied
rewards -> one step -> vLLM's `/v1/models` lists `tiny@1`, the next response through the proxy carries
`X-Policy-Step: 1`, and its stored completion names the adapter `tiny@1`.

The vLLM server is shared by the whole session: the adapter is unloaded again at the end, so later
tests see the server as they would have without this one.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from support import rows, tiny_settings, uvicorn_serving, wait_for

from rlproxy.compose import build_app

pytestmark = pytest.mark.vllm

REWARDS = [1.0, 0.0, 0.5, 0.25]  # one group of 4, varied: a real gradient


async def test_step_one_is_loaded_in_vllm_and_serves_the_next_request(
    vllm_backend, tiny_model_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    db = tmp_path / "rlproxy.db"
    settings = tiny_settings(
        tiny_model_dir,  # the trainer's base weights: the same folder vLLM serves
        tmp_path,
        backend="vllm",
        upstream=vllm_backend.base_url,  # attach: the session's server, never a second one
        cache_dir=str(cache_dir),
        engine_threads=None,
        group_size=4,
        groups_per_step=1,
        poll_interval=0.1,
        learning_rate=1e-3,
    )
    policy = vllm_backend.served_model  # "tiny": the default policy is the served base model
    adapter = f"{policy}@1"
    try:
        async with uvicorn_serving(build_app(settings), settings.port, start_timeout=120) as base:
            client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                for i, reward in enumerate(REWARDS):
                    run_id = f"vllm-e2e-{i}"
                    raw = await client.chat.completions.with_raw_response.create(
                        model=policy,
                        messages=[{"role": "user", "content": "Say a word."}],
                        max_tokens=4,
                        temperature=1.0,
                        seed=i,
                        extra_headers={"X-Run-Id": run_id, "X-Group-Id": "g"},
                    )
                    assert raw.headers["x-policy-step"] == "0"
                    resp = await http.post(f"/v1/runs/{run_id}/reward", json={"reward": reward})
                    assert resp.status_code == 200, resp.text

                # the trainer polls, trains one step, loads tiny@1 into vLLM, commits, flips the alias
                await wait_for(
                    lambda: rows(db, "SELECT count(*) FROM training_steps")[0][0] > 0,
                    300,
                    "the training step",
                )
                listed = httpx.get(f"{vllm_backend.base_url}/v1/models", timeout=30).json()["data"]
                assert {m["id"]: m.get("parent") for m in listed}.get(adapter) == policy

                step = None
                for attempt in range(100):  # the alias flips right after the commit
                    raw = await client.chat.completions.with_raw_response.create(
                        model=policy,
                        messages=[{"role": "user", "content": "Say a word."}],
                        max_tokens=4,
                        extra_headers={"X-Run-Id": f"after-{attempt}"},
                    )
                    step = raw.headers["x-policy-step"]
                    if step == "1":
                        break
                    await asyncio.sleep(0.05)
                assert step == "1"
                after = f"after-{attempt}"
                sql = "SELECT adapter, policy_step, status, token_ids FROM completions WHERE run_id = ?"
                await wait_for(lambda: rows(db, sql, after), 30, "the completion row")  # the writer batches
                ((stored_adapter, policy_step, status, token_ids),) = rows(db, sql, after)
    finally:
        await _unload(vllm_backend, adapter)
    assert (stored_adapter, policy_step, status) == (adapter, 1, "ok")
    assert json.loads(token_ids)[0]  # vLLM sampled from the adapter and the proxy captured the tokens
    status = dict(rows(db, "SELECT id, status || ':' || coalesce(trained_step, '') FROM runs"))
    assert {status[f"vllm-e2e-{i}"] for i in range(4)} == {"trained:1"}
    ((steps_policy, adapter_path),) = rows(db, "SELECT policy, adapter_path FROM training_steps")
    assert steps_policy == policy and Path(adapter_path).is_dir()


async def _unload(vllm_backend, name: str) -> None:
    """Leave the shared server as we found it (a 404 means the step never got that far)."""
    resp = await asyncio.to_thread(
        httpx.post, f"{vllm_backend.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60
    )
    assert resp.status_code in (200, 404), resp.text
