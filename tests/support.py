"""Test helpers shared by every test package (importable as `support`: tests/ is on sys.path).

The servers under test run in an asyncio loop on a background thread, so tests can use the real
synchronous `openai` SDK and stay independent of pytest-asyncio's loop scopes.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvicorn

from rlproxy.settings import Settings
from rlproxy.trainer.config import TrainerConfig


def require(ok: object, why: str) -> None:
    """Skip the test unless `ok`; `why` says how to enable it. In CI (CI=true) fail instead: nothing skips."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test: {why}")
    pytest.skip(why)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(db: Path, sql: str, *params: Any) -> list[tuple]:
    """The rows of `sql` on the SQLite file `db`, read-only (beside a running writer)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def tiny_settings(tiny_model_dir: Path, tmp_path: Path, **fields: Any) -> Settings:
    """`serve`'s settings (trainer on) on the tiny model, kept in one test's folder: the store
    `tmp_path/rlproxy.db`, checkpoints in `tmp_path/ck`, a free loopback port, one thread each."""
    values: dict[str, Any] = {
        "model": str(tiny_model_dir),
        "db_url": f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}",
        "port": free_port(),
        "train": True,
        "checkpoint_dir": str(tmp_path / "ck"),
        "train_threads": 1,
        "engine_threads": 1,
    }
    return Settings(**(values | fields))


def learning_config(tmp_path: Path, **fields: Any) -> TrainerConfig:
    """The learning tests' trainer (tiny model, a large learning rate, seed 0), checkpoints in
    `tmp_path/ck`, one thread, adapters unloaded at once."""
    values: dict[str, Any] = {
        "learning_rate": 5e-2,
        "micro_batch_size": 16,
        "checkpoint_dir": str(tmp_path / "ck"),
        "train_threads": 1,
        "keep_checkpoints": 2,
        "unload_grace": 0.0,
        "seed": 0,
    }
    return TrainerConfig(**(values | fields))


async def wait_for(predicate: Callable[[], Any], timeout: float = 120.0, what: str = "the condition") -> None:
    """Poll `predicate` every 50 ms until it is true; fail after `timeout` seconds."""
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@asynccontextmanager
async def uvicorn_serving(app: Any, port: int, start_timeout: float = 60.0) -> AsyncIterator[str]:
    """`app` under a real uvicorn server on 127.0.0.1:`port`; yields its base URL (without /v1)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(int(start_timeout / 0.05)):
            if server.started or task.done():
                break
            await asyncio.sleep(0.05)
        assert server.started, "the server exited during startup"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)


class LoopThread:
    """An asyncio loop on a daemon thread; `run(coro)` blocks until the coroutine is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="tests-loop")
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


S = TypeVar("S")


@contextmanager
def running(loop_thread: LoopThread, server: S) -> Iterator[S]:
    """`server` (anything with async `start()` and `stop()`: a stub upstream) started on the loop
    thread until the block ends."""
    loop_thread.run(server.start())  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        loop_thread.run(server.stop())  # type: ignore[attr-defined]


def make_lora(
    model_dir: Path,
    out: Path,
    seed: int,
    config_overrides: dict | None = None,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj", "o_proj"),
) -> Path:
    """Save a random (non-zero) LoRA adapter for the model in `model_dir` with peft's save_pretrained.

    `config_overrides` builds the base from a changed config (an adapter made for another model).
    """
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
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=list(target_modules), init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(out)
    return out


class ServerlessBackend:
    """The Backend protocol without a server, for tests whose subject is the trainer itself.

    Subclasses decide what `load_adapter` checks or records; the end-to-end tests use real engines.
    """

    base_url = "http://127.0.0.1:1"
    base_urls = ("http://127.0.0.1:1",)
    api_key = None
    served_model = "tiny"

    def __init__(self, model_path: str | Path) -> None:
        self._model_path = str(model_path)

    @property
    def model_path(self) -> str:
        return self._model_path

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def health(self) -> bool:
        return True

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    async def load_adapters_into(self, url: str, adapters: dict[str, str] | None = None) -> None: ...


class Capture:
    """An optimizer that only records the gradient it was asked to apply (trainer tests)."""

    def __init__(self, params: list[Any]) -> None:
        self.params, self.grads, self.state = params, None, {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.grads = [p.grad.detach().clone() for p in self.params]
