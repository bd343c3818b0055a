"""Start and fork: `--init-adapter DIR` and `rlproxy fork POLICY@N NEW`, through the real proxy.

A policy started from a LoRA folder, or forked from another policy's step, is served by that adapter
from its first request (`X-Policy-Step: 1`, and the same greedy text as the adapter loaded into the
engine under another name), and SQL says where it came from (`policies`, `training_steps.kind`).
The proxy is `build_app` (what `rlproxy serve` runs) on its own embedded engine under uvicorn; the
fork is the `rlproxy` command in another process, picked up by the proxy's poll.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from serving import rows, serving
from support import free_port, make_lora

from rlproxy.errors import ConfigError
from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.settings import Settings
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.offline import fork_policy, init_policies, validate_adapter

PROMPT = [{"role": "user", "content": "Name three colors."}]
RLPROXY = str(Path(sys.executable).parent / "rlproxy")  # the installed command


async def greedy(client: AsyncOpenAI, model: str) -> tuple[str, str]:
    """(X-Policy-Step, text) of a greedy answer to PROMPT."""
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=PROMPT, max_tokens=12, temperature=0
    )
    return raw.headers["x-policy-step"], raw.parse().choices[0].message.content or ""


async def direct(backend: EmbeddedBackend, model: str) -> str:
    """The engine's own greedy answer for `model` (no proxy): the reference."""
    async with httpx.AsyncClient(base_url=backend.base_url, timeout=60) as http:
        headers = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}
        body = {"model": model, "messages": PROMPT, "max_tokens": 12, "temperature": 0}
        resp = await http.post("/v1/chat/completions", json=body, headers=headers)
        resp.raise_for_status()
        return resp.json()["choices"][0]["message"]["content"] or ""


async def wait_for_step(client: AsyncOpenAI, model: str, step: str) -> tuple[str, str]:
    """Ask until the proxy serves `model` at `step` (its poll picks up another process's steps)."""
    for _ in range(300):
        try:
            got = await greedy(client, model)
            if got[0] == step:
                return got
        except Exception:  # 404 until the proxy knows the new policy
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{model} never served at step {step}")


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora(tiny_model_dir, tmp_path_factory.mktemp("init") / "lora", seed=3)


async def test_init_adapter_then_fork_serve_their_adapter(
    tiny_model_dir: Path, tmp_path: Path, adapter: Path
) -> None:
    db = tmp_path / "rlproxy.db"
    ck = tmp_path / "ck"
    settings = Settings(
        model=str(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{db}",
        port=free_port(),
        train=True,
        checkpoint_dir=str(ck),
        init_adapter=str(adapter),
        policy_poll_interval=0.1,
        train_threads=1,
        engine_threads=1,
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    async with serving(settings, backend) as base:
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        policy = backend.served_model
        await backend.load_adapter("reference", str(adapter))  # the same LoRA under another name
        reference, plain = await direct(backend, "reference"), await direct(backend, policy)
        assert reference != plain, "the test adapter must change the greedy answer"

        # --init-adapter: the first request of the default policy is served by the adapter
        assert await greedy(client, policy) == ("1", reference)

        # rlproxy fork, in another process: the running proxy picks the new policy up and serves it
        env = {**os.environ, "RLPROXY_DB_URL": str(db), "RLPROXY_CHECKPOINT_DIR": str(ck)}
        cmd = [RLPROXY, "fork", f"{policy}@1", "forked"]
        proc = await asyncio.create_subprocess_exec(
            *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()
        assert "forked@1" in out.decode()
        assert await wait_for_step(client, "forked", "1") == ("1", reference)

        # a name that exists, and a step that does not: one error line each, nothing changed
        for args, message in (
            (["fork", f"{policy}@1", "forked"], "already"),
            (["fork", f"{policy}@7", "x"], "no step 7"),
        ):
            proc = await asyncio.create_subprocess_exec(
                RLPROXY, *args, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == 1 and message in err.decode() and len(err.decode().splitlines()) == 1
    assert rows(db, "SELECT policy, step, kind, num_runs FROM training_steps ORDER BY policy") == [
        ("forked", 1, "fork", 0),
        (policy, 1, "init", 0),
    ]
    assert rows(db, "SELECT name, parent, parent_step, init_adapter FROM policies ORDER BY name") == [
        ("forked", policy, 1, None),
        (policy, None, None, str(adapter)),
    ]
    # the fork carries the checkpoint (its optimizer too, when the source has one)
    assert (ck / "forked" / "step-0001" / "adapter_model.safetensors").read_bytes() == (
        adapter / "adapter_model.safetensors"
    ).read_bytes()


async def test_a_policy_with_steps_keeps_them(tiny_model_dir: Path, tmp_path: Path, adapter: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'r.db'}"
    from rlproxy.storage.db import upgrade

    upgrade(url)
    config = TrainerConfig(checkpoint_dir=str(tmp_path / "ck"))
    args = (url, config, ["p"], str(adapter), str(tiny_model_dir), 8)
    assert await init_policies(*args) == ["p"]
    assert await init_policies(*args) == []  # a restart with the same setting: p is at step 1 already
    await fork_policy(url, config, "p@1", "q")
    with pytest.raises(Exception, match="already"):
        await fork_policy(url, config, "p@1", "q")
    with pytest.raises(ConfigError, match="POLICY@N"):
        await fork_policy(url, config, "p", "r")


def test_adapter_validation(tiny_model_dir: Path, tmp_path: Path, adapter: Path) -> None:
    assert validate_adapter(adapter, tiny_model_dir, 8)["r"] == 8
    with pytest.raises(ConfigError, match="max_lora_rank 4"):
        validate_adapter(adapter, tiny_model_dir, 4)
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        validate_adapter(tmp_path, tiny_model_dir, 8)
    other = make_lora(tiny_model_dir, tmp_path / "other", seed=1, config_overrides={"hidden_size": 64})
    with pytest.raises(ConfigError, match="does not fit the base model"):
        validate_adapter(other, tiny_model_dir, 8)
