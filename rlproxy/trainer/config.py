"""Trainer settings: plain values, each with its range or reason. Saved with every step and checkpoint.

The fields are the settings' trainer group (`rlproxy/settings.py` `TrainerSettings`): the settings
are below everything, so the trainer builds on them and they never import the trainer. Here are the
trainer's own rules about those values (the default learning rate by model size).

Imports nothing of the trainer's: every other trainer module may import it.
"""

from __future__ import annotations

from rlproxy.settings import TrainerSettings

# learning_rate=None: measured 1e-3 for SmolLM2-135M (hidden 576) with LoRA r=8/alpha=16 (LEARNING_FACTS),
# scaled down with the hidden size like Thinking Machines' fit of the best LoRA learning rate
# (~ hidden ** -0.78 for Llama models, "LoRA Without Regret", 2025).
LR_ANCHOR_HIDDEN = 576
LR_ANCHOR = 1e-3
LR_EXPONENT = 0.75
LR_FALLBACK = 1e-4  # a model whose config names no hidden size


def learning_rate_for(hidden_size: int | None) -> float:
    """The default learning rate of a model of this hidden size (None: LR_FALLBACK), 3 significant digits.

    Never above LR_ANCHOR: smaller models than the one measured (the test model `tiny`) are not
    extrapolated to larger rates.
    """
    if not hidden_size or hidden_size <= 0:
        return LR_FALLBACK
    return float(f"{LR_ANCHOR * min(1.0, LR_ANCHOR_HIDDEN / hidden_size) ** LR_EXPONENT:.3g}")


class TrainerConfig(TrainerSettings):
    """Everything a GRPO step needs to know: the settings' trainer group (`settings.group(TrainerConfig)`,
    or built directly in tests and tools)."""
