"""Inference fixtures: LoRA adapters made locally (the session's engine lives in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import make_lora


@pytest.fixture(scope="session")
def lora_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters "a" and "b" for the tiny model, and "other" made for a wider model of the same family."""
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": make_lora(tiny_model_dir, root / "a", seed=1),
        "b": make_lora(tiny_model_dir, root / "b", seed=2),
        "other": make_lora(tiny_model_dir, root / "other", seed=3, config_overrides={"hidden_size": 256}),
    }
