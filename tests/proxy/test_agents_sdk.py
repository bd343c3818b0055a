"""The OpenAI Agents SDK, unchanged but for its base URL and a run header, trained through `serve`.

The app is an `Agent` with a `@function_tool` and the SDK's default model class (`OpenAIResponsesModel`:
it talks to `POST /v1/responses`), its client set with `set_default_openai_client`, tracing off (no
internet). The proxy is `build_app` (what `rlproxy serve` runs) under a real uvicorn server with the
trainer on, in front of the embedded engine, and in front of the real vLLM (`vllm` marker).

The tiny model is random and never calls a tool by itself, so the policy starts at a step 1 that was
taught to call `get_time` (tests/tool_adapter.py: a supervised LoRA saved as the trainer's checkpoint;
`serve` publishes it on start, as it does after a restart). At temperature 0 every episode is then two
turns: the tool call, and the answer after the tool's output. Two rewarded episodes make a group, the
trainer takes step 2 from that checkpoint, and the next request is served by `{policy}@2`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from readme_blocks import blocks
from support import rows, tiny_settings, uvicorn_serving, wait_for
from tool_adapter import ANSWER, CACHE_NAME, TOOL_CALL, make_tool_checkpoint

from rlproxy.compose import build_app
from rlproxy.settings import Settings

agents = pytest.importorskip("agents", reason="openai-agents is in the dev extra: pip install -e '.[dev]'")
from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from agents.models.multi_provider import MultiProvider  # noqa: E402
from agents.models.openai_responses import OpenAIResponsesModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
POLICY = "tiny"  # the served name of the tiny model on both backends: the default policy
QUESTION = "What time is it?"
TOOL_OUTPUT = "12:00"


@function_tool
def get_time() -> str:
    """Current time."""
    return TOOL_OUTPUT


@pytest.fixture(scope="session")
def tool_checkpoint(tiny_model_dir: Path, cache_dir: Path) -> Path:
    """Checkpoint 1 of POLICY that calls `get_time` (trained once, cached across sessions)."""
    import torch

    torch.set_num_threads(1)
    return make_tool_checkpoint(tiny_model_dir, cache_dir / CACHE_NAME, POLICY)


def serving(settings: Settings, backend: Any = None) -> AbstractAsyncContextManager[str]:
    """`build_app` under uvicorn on settings.port; yields the base URL (without /v1)."""
    return uvicorn_serving(build_app(settings, backend), settings.port, start_timeout=300)


def _settings(tmp_path: Path, tiny_model_dir: Path, tool_checkpoint: Path, **extra: Any) -> Settings:
    ck = tmp_path / "ck"
    shutil.copytree(tool_checkpoint.parent.parent, ck)  # the trainer writes step 2 next to it
    values = {"engine_threads": None, "group_size": 2, "groups_per_step": 1, "poll_interval": 0.1}
    return tiny_settings(tiny_model_dir, tmp_path, **(values | {"learning_rate": 1e-3} | extra))


def _use_proxy(base: str, run_id: str) -> AsyncOpenAI:
    """What the app changes: the client's base URL, and its episode's run header."""
    client = AsyncOpenAI(
        base_url=f"{base}/v1",
        api_key="unused",
        default_headers={"X-Run-Id": run_id},
        max_retries=0,
        timeout=120,
    )
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("responses")
    set_tracing_disabled(True)
    return client


def _agent() -> Agent:
    return Agent(
        name="clock",
        instructions="You tell the time.",
        model=POLICY,
        tools=[get_time],
        model_settings=ModelSettings(temperature=0.0, max_tokens=32),
    )


def _check_episode(result: Any) -> None:
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert result.new_items[1].output == TOOL_OUTPUT
    assert result.final_output == ANSWER
    assert len(result.raw_responses) == 2  # two model turns


async def _check_stored(db: Path, run_id: str, tokenizer: Any, step: int) -> None:
    """Both turns stored with exact token ids and logprobs, sampled by `{POLICY}@{step}`."""
    sql = (
        "SELECT status, policy_step, adapter, token_ids, logprobs, prompt_token_ids FROM completions "
        "WHERE run_id = ? ORDER BY seq"
    )
    await wait_for(lambda: len(rows(db, sql, run_id)) >= 2, 30, "the writer")  # it batches
    got = rows(db, sql, run_id)
    assert [r[:3] for r in got] == [("ok", step, f"{POLICY}@{step}")] * 2, [r[:3] for r in got]
    texts = []
    for _, _, _, token_ids, logprobs, prompt_ids in got:
        ids, lps = json.loads(token_ids)[0], json.loads(logprobs)[0]
        assert len(ids) == len(lps) > 0 and json.loads(prompt_ids)
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    assert texts == [TOOL_CALL, ANSWER]
    # the second turn's prompt holds the tool's output: the SDK sent the function_call_output item
    second_prompt = tokenizer.decode(json.loads(got[1][5]))
    assert TOOL_OUTPUT in second_prompt and "get_time" in second_prompt
    roles = [r[0] for r in rows(db, "SELECT role FROM messages WHERE run_id = ? ORDER BY seq, idx", run_id)]
    assert "tool" in roles and "assistant" in roles, roles


async def agent_episodes_train_and_publish(base: str, db: Path, tokenizer: Any) -> None:
    """The whole story against a proxy at `base` whose policy serves step 1 (the tool caller)."""
    # streamed: Runner.run_streamed consumes the proxy's Responses events
    _use_proxy(base, "agent-stream")
    assert isinstance(MultiProvider().get_model(POLICY), OpenAIResponsesModel)  # the SDK's default
    streamed = Runner.run_streamed(_agent(), QUESTION, max_turns=3)
    events = [event.type async for event in streamed.stream_events()]
    assert {"raw_response_event", "run_item_stream_event"} <= set(events)
    _check_episode(streamed)
    await _check_stored(db, "agent-stream", tokenizer, step=1)

    # two episodes, rewarded differently: one group of 2 -> a GRPO step from the tool caller
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        for run_id, reward in [("agent-a", 1.0), ("agent-b", 0.0)]:
            _use_proxy(base, run_id)
            _check_episode(await Runner.run(_agent(), QUESTION, max_turns=3))
            await _check_stored(db, run_id, tokenizer, step=1)
            resp = await http.post(f"/v1/runs/{run_id}/reward", json={"reward": reward})
            assert resp.status_code == 200, resp.text
        await wait_for(lambda: rows(db, "SELECT max(step) FROM training_steps")[0][0] == 2, 300, "step 2")

    # the next request of the app is served by the adapter the step published
    client = _use_proxy(base, "agent-after")
    step = None
    for _ in range(100):  # the alias flips right after the commit
        raw = await client.responses.with_raw_response.create(
            model=POLICY, input=QUESTION, max_output_tokens=4, temperature=0.0
        )
        step = raw.headers["x-policy-step"]
        if step == "2":
            break
        await asyncio.sleep(0.05)
    assert step == "2"
    assert raw.parse().object == "response"
    status = dict(rows(db, "SELECT id, status || ':' || coalesce(trained_step, '') FROM runs"))
    assert (status["agent-a"], status["agent-b"]) == ("trained:2", "trained:2")
    assert status["agent-stream"].startswith("open")


async def test_agents_sdk_on_the_embedded_engine(
    tiny_model_dir: Path, tool_checkpoint: Path, tiny_tokenizer: Any, tmp_path: Path
) -> None:
    from rlproxy.inference.embedded import EmbeddedBackend

    settings = _settings(tmp_path, tiny_model_dir, tool_checkpoint, engine_threads=1)
    async with serving(settings, EmbeddedBackend(str(tiny_model_dir), threads=1)) as base:
        await agent_episodes_train_and_publish(base, tmp_path / "rlproxy.db", tiny_tokenizer)


async def test_the_readme_agents_example_runs_unchanged(
    tiny_model_dir: Path, tool_checkpoint: Path, tmp_path: Path
) -> None:
    """README's Agents SDK block, run as it is, with only OPENAI_BASE_URL set (its model name mapped
    to the policy, as the README says for apps with another model name), at the SDK's default
    sampling: the episode is stored with both turns and its reward.

    The block sets no temperature, so the model's own defaults apply: the tiny model's copy here
    ships `top_p: 0.9` in its generation config (as many models ship one), under which the taught
    tokens (each ~0.99 likely) are the only candidates, so the episode is deterministic."""
    from rlproxy.inference.embedded import EmbeddedBackend

    page = ROOT / "docs" / "clients.md"  # the Agents SDK block moved there with its section
    (block,) = [b for b in blocks(page.read_text(), "docs/clients.md") if "from agents import" in b.code]
    model_dir = tmp_path / "models" / POLICY  # the same weights, served under the same name
    shutil.copytree(tiny_model_dir, model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation, "top_p": 0.9}))
    settings = _settings(tmp_path, model_dir, tool_checkpoint, engine_threads=1, model_map="*=tiny")
    db = tmp_path / "rlproxy.db"
    async with serving(settings, EmbeddedBackend(str(model_dir), threads=1)) as base:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "RLPROXY_"))}
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", block.code],
            env={**env, "OPENAI_BASE_URL": f"{base}/v1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == ANSWER
        sql = (
            "SELECT r.id, r.reward, count(c.id) FROM runs r JOIN completions c ON c.run_id = r.id "
            "GROUP BY r.id"
        )
        await wait_for(lambda: rows(db, sql) and rows(db, sql)[0][2] == 2, 30, "the episode's rows")
    ((run_id, reward, turns),) = rows(db, sql)
    assert run_id.startswith("episode-") and reward == 1.0 and turns == 2


@pytest.mark.vllm
async def test_agents_sdk_on_vllm(
    vllm_backend: Any, tiny_model_dir: Path, tool_checkpoint: Path, tiny_tokenizer: Any, tmp_path: Path
) -> None:
    settings = _settings(
        tmp_path, tiny_model_dir, tool_checkpoint, backend="vllm", upstream=vllm_backend.base_url
    )
    try:
        async with serving(settings) as base:
            await agent_episodes_train_and_publish(base, tmp_path / "rlproxy.db", tiny_tokenizer)
    finally:  # leave the session's vLLM as we found it
        for step in (1, 2):
            resp = await asyncio.to_thread(
                httpx.post,
                f"{vllm_backend.base_url}/v1/unload_lora_adapter",
                json={"lora_name": f"{POLICY}@{step}"},
                timeout=60,
            )
            assert resp.status_code in (200, 404), resp.text
