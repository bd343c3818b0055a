"""The task and its reward, in plain Python: two turns, scored by code.

Turn 1: "Pick a number between 1 and 10. Reply with digits only."  The model answers, say "7".
Turn 2 (the environment's reply): "Add one to your number and reply with only the result."  -> "8".

Reward in [0, 1]: 0.3 when the first reply is digits only, plus 0.7 when the second reply is
exactly the first number plus one. The partial credit matters: an untrained SmolLM2-135M almost
never gets both turns right, and GRPO learns nothing from a group whose rewards are all equal, so
the easier half of the task gives the first gradients (see LEARNING_FACTS: 0.03 -> 0.95 in minutes).
"""

from __future__ import annotations

import re

FIRST_PROMPT = "Pick a number between 1 and 10. Reply with digits only."
SECOND_PROMPT = "Add one to your number and reply with only the result."
DIGITS_WEIGHT = 0.3
CORRECT_WEIGHT = 0.7

_DIGITS = re.compile(r"\d+")
_INTEGER = re.compile(r"-?\d+")


def _clean(text: str | None) -> str:
    """Strip whitespace and one trailing full stop: "8." and " 8\n" both count as "8"."""
    text = (text or "").strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def first_number(text: str | None) -> int | None:
    """The number the model picked: the first integer in its reply, wherever it is."""
    match = _INTEGER.search(text or "")
    return int(match.group()) if match else None


def score(first_reply: str | None, second_reply: str | None) -> tuple[float, dict[str, float]]:
    """(reward, metrics) for one episode; metrics say which half was earned."""
    digits_only = _DIGITS.fullmatch(_clean(first_reply)) is not None
    picked = first_number(first_reply)
    answer = _clean(second_reply)
    correct = picked is not None and _DIGITS.fullmatch(answer) is not None and int(answer) == picked + 1
    reward = DIGITS_WEIGHT * digits_only + CORRECT_WEIGHT * correct
    return round(reward, 6), {"digits_only": float(digits_only), "correct": float(correct)}
