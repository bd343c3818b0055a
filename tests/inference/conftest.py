"""Inference fixtures: one embedded engine per session (torch threads 1), LoRA adapters made locally.

The engine's uvicorn server runs in its own event loop on a background thread, so the tests can use
the real synchronous `openai` SDK and stay independent of pytest-asyncio's loop scopes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest


class LoopThread:
    """An asyncio loop on a daemon thread; `run(coro)` blocks until the coroutine is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="session")
def embedded_backend(tiny_model_dir: Path, loop_thread: LoopThread) -> Iterator[Any]:
    """The embedded backend serving the tiny model on a loopback port for the whole session."""
    import torch

    from rlproxy.inference.embedded import EmbeddedBackend

    torch.set_num_threads(1)
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1, max_batch=16)
    loop_thread.run(backend.start())
    yield backend
    loop_thread.run(backend.stop())


def make_lora(model_dir: Path, out: Path, seed: int, config_overrides: dict | None = None) -> Path:
    """Save a random (non-zero) LoRA adapter for the model in `model_dir` with peft's save_pretrained."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if config_overrides:
        cfg = AutoConfig.from_pretrained(model_dir)
        for key, value in config_overrides.items():
            setattr(cfg, key, value)
        model = AutoModelForCausalLM.from_config(cfg)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(model, cfg)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def lora_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters "a" and "b" for the tiny model, and "other" made for a wider model of the same family."""
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": make_lora(tiny_model_dir, root / "a", seed=1),
        "b": make_lora(tiny_model_dir, root / "b", seed=2),
        "other": make_lora(tiny_model_dir, root / "other", seed=3, config_overrides={"hidden_size": 256}),
    }


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
