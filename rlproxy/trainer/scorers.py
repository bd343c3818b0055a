"""Scorers: what compares the K answers of a sibling group and gives each a number (docs/siblings.md).

A scorer is told the app's request (the conversation up to the call, the tools it offered) and the K
candidate answers, and returns K finite numbers; only their differences train (the group's baseline
is their mean). A scorer that fails, times out or answers nonsense raises `ScorerError`: the group
waits and is tried again, then fails, visibly; it is never trained on a guess.

    checks   built in, needs no one: tool calls that parse and fit the offered schemas, JSON that
             `response_format` asked for, an answer not cut by `max_tokens` (partial credit, [0, 1])
    url      the app's HTTP endpoint (`scorer_url`)
    judge    the judge model, the candidates side by side

(Skeleton: the contract the siblings service and the shadow check are written against.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlproxy.errors import RLProxyError

if TYPE_CHECKING:
    import httpx

    from rlproxy.settings import Settings


class ScorerError(RLProxyError):
    """A scorer failed, timed out or answered nonsense (the message says which, in one line)."""


@dataclass
class ScoreRequest:
    """One sibling group (or shadow pair) to score."""

    group_id: str
    policy: str
    endpoint: str | None  # completions.endpoint of the branched call
    request: dict[str, Any]  # the app's stored request body (messages, tools, response_format, max_tokens)
    candidates: list[dict[str, Any]]  # resample.as_message dicts: role, content, tool_calls, finish_reason
    scorer_url: str | None = None  # a key's own scorer, else settings.scorer_url


class Scorer(Protocol):
    """Gives each candidate of a request a finite number; raises ScorerError."""

    name: str

    async def score(self, req: ScoreRequest) -> list[float]: ...


def check_scores(req: ScoreRequest) -> list[float]:
    """The built-in checks: each candidate's share of the checks that apply to it, in [0, 1]."""
    return [0.0 if c.get("finish_reason") == "length" else 1.0 for c in req.candidates]


class ChecksScorer:
    """The built-in checks alone."""

    name = "checks"

    async def score(self, req: ScoreRequest) -> list[float]:
        return check_scores(req)


def build_scorer(settings: Settings, client: httpx.AsyncClient) -> Scorer:
    """The scorer `settings.scorer` names."""
    return ChecksScorer()
