"""The one settings object. Every field reads `RLPROXY_<NAME>`; CLI options override it.

The README's configuration table is generated from this class (a test keeps them in sync).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlproxy.trainer.config import TrainerConfig


class Settings(BaseSettings, TrainerConfig):
    """rlproxy's configuration: server, backend, store, capture and (inherited) trainer fields."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_", extra="ignore")

    # --- server ---
    host: str = Field("127.0.0.1", description="address the proxy listens on")
    port: int = Field(8000, ge=0, le=65535, description="port the proxy listens on (0 = any free port)")
    api_key: str | None = Field(
        None, description="if set, every route but /healthz needs `Authorization: Bearer <key>`"
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="largest request body accepted (413 above)"
    )
    # --- inference backend ---
    backend: Literal["embedded", "vllm"] = Field("embedded", description="inference server behind the proxy")
    model: str = Field(
        "smollm2-135m", description="built-in name (smollm2-135m, tiny) or a Hugging Face model folder"
    )
    upstream: str | None = Field(None, description="URL of a running OpenAI-compatible server to attach to")
    upstream_timeout: float = Field(
        600.0, gt=0, description="seconds to wait for the upstream's answer (504 after)"
    )
    cache_dir: str = Field("~/.cache/rlproxy", description="where prepared built-in models are cached")
    engine_port: int = Field(
        0, ge=0, le=65535, description="loopback port of the embedded engine (0 = any free)"
    )
    engine_threads: int | None = Field(
        None, ge=1, description="torch threads of the embedded engine; None = default"
    )
    engine_max_batch: int = Field(16, ge=1, description="most sequences the embedded engine decodes together")
    vllm_python: str = Field(
        "python", description="python executable that has vLLM (e.g. .venv-vllm/bin/python)"
    )
    vllm_args: str = Field("", description="extra arguments for the launched vLLM server")
    vllm_startup_timeout: float = Field(
        300.0, gt=0, description="seconds to wait for a launched vLLM's /health"
    )
    max_lora_rank: int = Field(8, ge=1, description="largest LoRA rank the backend must accept")
    # --- store ---
    db_url: str = Field(
        "sqlite+aiosqlite:///rlproxy.db", description="SQLAlchemy URL (or a SQLite file path)"
    )
    flush_interval: float = Field(
        0.05, ge=0, description="seconds the writer waits to batch rows into one commit"
    )
    write_queue_max: int = Field(
        10_000, ge=1, description="uncommitted completions after which new requests wait for the store"
    )
    run_expiry: float = Field(
        86400.0, gt=0, description="seconds after which an unrewarded open run is expired"
    )
    # --- policies ---
    model_map: str = Field(
        "", description="comma list `name=policy` or `*=policy` for apps that hard-code a model"
    )
    # --- trainer (plus the inherited TrainerConfig fields) ---
    train: bool = Field(True, description="run the trainer inside `serve`")
    blocking_train: bool = Field(
        False, description="hold new requests while a step trains (single-GPU memory)"
    )


def sqlite_url(db: str) -> str:
    """Accept a bare SQLite path (`./rlproxy.db`) where a URL is expected."""
    return db if "://" in db else f"sqlite+aiosqlite:///{db}"


def settings_markdown() -> str:
    """The README's configuration table, generated from `Settings` (a test keeps the README in sync)."""
    rows = ["| setting | environment variable | default | what it does |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default if field.default_factory is None else field.default_factory()
        default_text = ", ".join(default) if isinstance(default, list) else default
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | `RLPROXY_{name.upper()}` | `{default_text}` | {description} |")
    return "\n".join(rows)
