"""The demo tasks' own checkers at the level of one model call (what the demo's url scorer serves).

A sibling group is K answers to one stored call; the scorer sees the conversation up to that call
and the K candidate assistant messages, and gives each a number. These checkers give each candidate
the task's own reward as far as that call can judge it, with the task's reward functions
(`number_game.score`, `directory.score`), never a second definition:

  number game, turn 1 (no answer yet): the digits-only part (`DIGITS_WEIGHT`), the reward of an
      episode whose second reply is still missing; the reward has no in-range part, so neither has
      this;
  number game, turn 2: the correct-answer part (`CORRECT_WEIGHT`): the number plus one, the number
      read from the first answer in the conversation;
  directory: the episode's reward had it ended with this candidate: the people looked up so far
      (the tool results in the conversation) plus the candidate's own lookup, whether any reply so
      far tried a call, and the candidate's text as the final answer when it is not a tool call.
      Across one group the conversation is the same, so only what the candidate adds differs.

A candidate is the wire format's `{"content", "tool_calls", "finish_reason"}` (docs/siblings.md);
the agent reads `content` the way the app does (`message.content or ""`) and only a reply's first
tool call (one lookup per reply).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rlproxy.demo import directory, number_game

Message = dict[str, Any]


def _role(messages: list[Message], role: str) -> list[Message]:
    return [m for m in messages if isinstance(m, dict) and m.get("role") == role]


def number_call(messages: list[Message], candidate: Message) -> float:
    """The number game's reward part that this call decides (see the module's docstring)."""
    reply = candidate.get("content") or ""
    answers = _role(messages, "assistant")
    if not answers:  # turn 1: digits only (an episode whose second reply is missing)
        return number_game.score(reply, None)[0]
    first = answers[0].get("content") or ""  # turn 2: the number plus one, the number from turn 1
    return round(number_game.score(first, reply)[0] - number_game.score(first, None)[0], 6)


def _asked(messages: list[Message]) -> tuple[str, str] | None:
    for m in _role(messages, "user"):
        found = directory._ASKED.search(str(m.get("content")))
        if found:
            return found.group(1), found.group(2)
    return None


def _tried(message: Message) -> bool:
    """A reply that tried a tool call, parsed or not (the reward's attempt part)."""
    return bool(message.get("tool_calls")) or directory.TOOL_OPEN in (message.get("content") or "")


def directory_call(messages: list[Message], candidate: Message) -> float:
    """The directory episode's reward had it ended with `candidate` (see the module's docstring)."""
    people = _asked(messages)
    if people is None:
        return 0.0
    looked_up: set[str] = set()
    for m in _role(messages, "tool"):  # a found lookup's result carries the person's extension
        try:
            result = json.loads(m.get("content") or "{}")
        except (TypeError, ValueError):
            continue
        if isinstance(result, dict) and "extension" in result and isinstance(result.get("name"), str):
            looked_up.add(result["name"])
    attempted = any(_tried(m) for m in _role(messages, "assistant")) or _tried(candidate)
    answer: str | None = candidate.get("content") or ""
    calls = candidate.get("tool_calls") or []
    if calls:  # one lookup per reply: the agent runs the first call only
        answer = None
        function = (calls[0].get("function") if isinstance(calls[0], dict) else None) or {}
        if function.get("name") == "lookup":
            _, found = directory.lookup(function.get("arguments"))
            if found:
                looked_up.add(found)
    return directory.score(people, answer, looked_up, attempted)[0]


CHECKERS: dict[str, Callable[[list[Message], Message], float]] = {
    "number": number_call,
    "directory": directory_call,
}


def score_body(task: str, body: dict[str, Any]) -> list[float]:
    """The scores of a url-scorer request body (docs/siblings.md's wire format), in candidate order."""
    check = CHECKERS[task]
    messages = body["messages"]
    candidates = sorted(body["candidates"], key=lambda c: c.get("index", 0))
    return [float(check(messages, c)) for c in candidates]
