"""Shared fixtures: models made once per session, free loopback ports, a fresh database per test."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RLPROXY_CACHE_DIR", ROOT / ".cache" / "rlproxy"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
