"""Proxy fixtures: one embedded engine per session, a fresh proxy (and database) per test.

Servers run on a background event loop (`LoopThread`): the session's embedded engine on the tiny
model (1 torch thread), stub upstreams for the tests that are about the proxy itself, and each
test's proxy under a real uvicorn server on a loopback port. Tests talk to them with the real
`openai` SDK (sync or async) and read the store with the stdlib `sqlite3` module, read-only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proxy_helpers import LoopThread, ProxyServer, make_lora
from support import running


@pytest.fixture(scope="session")
def engine_backend(embedded_backend: Any) -> Any:
    """The session's embedded engine on the tiny model (the real upstream)."""
    return embedded_backend


@pytest.fixture
def tool_stub(loop_thread: LoopThread) -> Iterator[Any]:
    """An upstream that answers every chat request with a get_weather call (tests/proxy/fakes.py)."""
    from fakes import ToolStub

    with running(loop_thread, ToolStub()) as s:
        yield s


@pytest.fixture
def make_proxy(loop_thread: LoopThread, tmp_path: Path) -> Iterator[Any]:
    """make_proxy(upstream_url, model=..., **settings) -> a started ProxyServer on a fresh database.

    The backend attaches to `upstream_url` (VLLMBackend in attach mode), so the session's engine or a
    stub is shared and never stopped by a test's proxy.
    """
    from rlproxy.compose import build_app
    from rlproxy.inference.vllm import VLLMBackend
    from rlproxy.settings import Settings

    started: list[ProxyServer] = []

    def make(upstream: str, model: str = "stub-model", backend: Any = None, **overrides: Any) -> ProxyServer:
        db_path = tmp_path / f"proxy{len(started)}.db"
        fields = {"db_url": f"sqlite+aiosqlite:///{db_path}", "train": False, "model": model, **overrides}
        settings = Settings(**fields)
        backend = backend or VLLMBackend(model, upstream=upstream)
        server = ProxyServer(loop_thread, build_app(settings, backend), db_path).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def engine_proxy(make_proxy: Any, engine_backend: Any, tiny_model_dir: Path) -> ProxyServer:
    """A proxy in front of the session's embedded engine."""
    return make_proxy(engine_backend.base_url, model=str(tiny_model_dir))


@pytest.fixture(scope="session")
def lora_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora(tiny_model_dir, tmp_path_factory.mktemp("lora") / "a", seed=1)
