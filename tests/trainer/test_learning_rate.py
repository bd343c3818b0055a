"""learning_rate=None: chosen by the model's hidden size, anchored on what SmolLM2-135M learned with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlproxy.settings import Settings
from rlproxy.trainer.config import LR_FALLBACK, TrainerConfig, learning_rate_for
from rlproxy.trainer.model import load_policy
from rlproxy.trainer.step import make_optimizer


@pytest.mark.parametrize(
    ("hidden", "lr"),
    [
        (576, 1e-3),  # SmolLM2-135M: measured (LEARNING_FACTS, the number game)
        (896, 7.18e-4),  # Qwen2.5-0.5B
        (2048, 3.86e-4),  # Qwen2.5-3B
        (3584, 2.54e-4),  # Qwen2.5-7B
        (64, 1e-3),  # smaller than measured: not extrapolated upwards
        (None, LR_FALLBACK),
    ],
)
def test_rule(hidden: int | None, lr: float) -> None:
    assert learning_rate_for(hidden) == pytest.approx(lr)


def test_default_is_by_model_size_and_an_explicit_rate_wins(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert TrainerConfig().learning_rate is None and Settings().learning_rate is None
    hidden = json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]
    config = TrainerConfig(checkpoint_dir=str(tmp_path))
    model, _ = load_policy(str(tiny_model_dir), config)
    assert [g["lr"] for g in make_optimizer(model, config).param_groups] == [learning_rate_for(hidden)]
    chosen = config.model_copy(update={"learning_rate": 3e-4})
    assert [g["lr"] for g in make_optimizer(model, chosen).param_groups] == [3e-4]
