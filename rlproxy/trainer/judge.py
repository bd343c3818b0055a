"""Judge rewards (RULER-style): an LLM scores a group's trajectories together, and its scores are the rewards.

    trainer poll ──> judge_groups (storage/judging.py: groups waiting for the judge, same readiness)
        ──> one chat call per group: rubric + every trajectory, JSON asked for
        ──> parse_scores (judge_prompt.py): one score in [0, 1] and a short explanation per trajectory
              malformed -> call again (judge_max_attempts in all) -> runs `failed`, reason `judge_failed`
        ──> store_scores: reward, reward_source 'judge', judge_explanation (one transaction)
        ──> the trainer's usual selection takes the group like any rewarded one

The judge is any OpenAI-compatible server (`judge_base_url`, `judge_model`); by default the proxy's
own upstream and served base model, called directly on the upstream, never through the proxy's
capture, so judge calls are never training data. A judge that cannot be reached (connection error,
timeout, 429/5xx) leaves its groups untouched; the next poll after a back-off tries again.

Only asyncio and httpx here: the judge waits on the network, never on torch, so it runs on the
event loop between two of the trainer's polls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from rlproxy.settings import JudgeSettings
from rlproxy.storage.judging import JudgeGroup, judge_groups, store_scores
from rlproxy.storage.models import RunStatus
from rlproxy.storage.training import StatusReason, mark_runs
from rlproxy.trainer.judge_prompt import (
    DEFAULT_RUBRIC,
    JudgeOutputError,
    build_messages,
    parse_scores,
)

log = logging.getLogger(__name__)

Mode = Literal["off", "missing", "always"]
MODES: tuple[str, ...] = ("off", "missing", "always")
MAX_BACKOFF = 60.0  # seconds between two tries of an unreachable judge, at most
RETRY_TEMPERATURE = 0.7  # at least this on a retry: a greedy judge would repeat the same malformed answer


class JudgeUnavailable(RuntimeError):
    """The judge could not be asked (connection error, timeout, 429 or 5xx): its groups wait."""


def parse_policy_modes(text: str) -> dict[str, Mode]:
    """`judge_policies`: "a=always,b=off" -> {"a": "always", "b": "off"}; ValueError on a bad entry."""
    out: dict[str, Mode] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, mode = (s.strip() for s in part.rpartition("="))
        if not sep or not name or mode not in MODES:
            raise ValueError(f"judge_policies: {part!r} is not `policy=off|missing|always`")
        out[name] = mode  # type: ignore[assignment]
    return out


# ---------------------------------------------------------------------- the service


@dataclass
class JudgeStats:
    """What /metrics reports (proxy/metrics.py reads these at scrape time)."""

    calls: dict[str, int] = field(default_factory=lambda: {"ok": 0, "malformed": 0, "error": 0})
    groups: dict[str, int] = field(default_factory=lambda: {"scored": 0, "failed": 0})
    seconds: float = 0.0  # summed over calls
    prompt_tokens: int = 0
    completion_tokens: int = 0


Endpoint = tuple[str, str, str | None]  # (base URL ending in /v1, model, bearer key)


class Judge:
    """Scores the groups waiting for the judge; `judge_ready` is called by the trainer before it selects."""

    def __init__(
        self,
        settings: JudgeSettings,
        resolve: Callable[[], Endpoint] | None = None,
        on_call: Callable[[str, float, int, int], None] | None = None,
        on_group: Callable[[str], None] | None = None,
    ) -> None:
        """`settings`: the settings' judge group (ValueError on a bad `judge_policies` entry).
        `resolve()` names the default endpoint (the upstream) when they name no base URL or model;
        `on_call(outcome, seconds, prompt_tokens, completion_tokens)` sees every call and
        `on_group(outcome)` every group scored or failed (the proxy's /metrics)."""
        self.settings = settings
        self.policies = parse_policy_modes(settings.judge_policies)  # per-policy mode overrides
        self.resolve = resolve
        self.on_call = on_call
        self.on_group = on_group
        self.stats = JudgeStats()
        self._client: httpx.AsyncClient | None = None
        self._json_mode = True  # response_format json_object, until the server refuses it
        self._retry_at = 0.0  # time.monotonic() before which an unreachable judge is not asked
        self._backoff = 1.0

    @property
    def off(self) -> bool:
        """Off for every policy: no judge is needed."""
        return self.settings.judge == "off" and all(m == "off" for m in self.policies.values())

    def mode_of(self, policy: str) -> Mode:
        return self.policies.get(policy, self.settings.judge)

    def rubric_of(self, policy: str, requested: str | None = None) -> str:
        s = self.settings
        return requested or s.judge_rubrics.get(policy) or s.judge_rubric or DEFAULT_RUBRIC

    def endpoint(self) -> Endpoint:
        s = self.settings
        given = s.judge_base_url and s.judge_model
        default = self.resolve() if self.resolve is not None and not given else None
        base = s.judge_base_url or (default[0] if default else None)
        model = s.judge_model or (default[1] if default else None)
        if not base or not model:
            raise JudgeUnavailable("no judge: set judge_base_url and judge_model")
        key = s.judge_api_key if s.judge_base_url else (s.judge_api_key or (default[2] if default else None))
        return base.rstrip("/"), model, key

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def judge_ready(self, engine: Any, *, group_size: int, group_timeout: float) -> int:
        """Judge every group that waits for the judge; returns the groups scored or failed."""
        if time.monotonic() < self._retry_at:
            return 0
        groups = await judge_groups(
            engine, group_size=group_size, group_timeout=group_timeout, mode_of=self.mode_of
        )
        done = 0
        for group in groups:
            if self.mode_of(group.policy) == "off":  # completed for a judge that will never come
                waiting = [r.run_id for r in group.runs if r.reward is None]
                n = await mark_runs(engine, waiting, RunStatus.failed, StatusReason.judge_off)
                log.warning(
                    "judge is off for policy %r: %d run(s) waiting for it marked failed", group.policy, n
                )
                continue
            try:
                await self.judge_group(engine, group)
            except JudgeUnavailable as exc:
                self._retry_at = time.monotonic() + self._backoff
                log.warning(
                    "judge unavailable (%s); %d group(s) wait, next try in %.0f s",
                    exc,
                    len(groups) - done,
                    self._backoff,
                )
                self._backoff = min(MAX_BACKOFF, self._backoff * 2)
                return done
            done += 1
        self._backoff = 1.0
        return done

    def needs_judge(self, policy: str, sources: list[str | None]) -> bool:
        """True for a ready group the judge must score first (judge=always and an app reward in it)."""
        # a sibling group (reward_source 'sibling') was scored by its own scorer: never judged again
        return self.mode_of(policy) == "always" and any(s not in ("judge", "sibling") for s in sources)

    async def judge_group(self, engine: Any, group: JudgeGroup) -> list[tuple[float, str]] | None:
        """Score one group and store its scores; malformed answers max_attempts times mark it failed.

        Returns the scores, or None when the group was marked failed. Raises JudgeUnavailable when
        the judge cannot be asked (the group is left as it was)."""
        s = self.settings
        requested = next((r.rubric for r in group.runs if r.rubric), None)
        messages = build_messages(group, self.rubric_of(group.policy, requested), s.judge_max_chars)
        problem = ""
        for attempt in range(1, s.judge_max_attempts + 1):
            temperature = s.judge_temperature if attempt == 1 else max(s.judge_temperature, RETRY_TEMPERATURE)
            try:
                scores = await self.ask(messages, len(group.runs), temperature)
            except JudgeOutputError as exc:
                problem = str(exc)
                log.info(
                    "judge: malformed answer for group %s (try %d/%d): %s",
                    group.group_id,
                    attempt,
                    s.judge_max_attempts,
                    exc,
                )
                continue
            n = await store_scores(
                engine,
                {r.run_id: s for r, s in zip(group.runs, scores, strict=True)},
                replace_app=self.mode_of(group.policy) == "always",
            )
            self._group("scored")
            log.info(
                "judge scored group %s of %s (%d runs): %s",
                group.group_id,
                group.policy,
                n,
                [round(s, 3) for s, _ in scores],
            )
            return scores
        n = await mark_runs(engine, group.run_ids, RunStatus.failed, StatusReason.judge_failed)
        self._group("failed")
        log.warning(
            "judge: group %s of %s failed (%d runs, judge_failed): %d malformed answers, last: %s",
            group.group_id,
            group.policy,
            n,
            s.judge_max_attempts,
            problem,
        )
        return None

    async def ask(
        self, messages: list[dict[str, str]], n: int, temperature: float
    ) -> list[tuple[float, str]]:
        """One judge call read as n (score, explanation) pairs (also the sibling scorer's, scorers.py).

        Raises JudgeOutputError when the answer is malformed and JudgeUnavailable when the judge cannot
        answer; every call is counted (ok, malformed or error)."""
        text, seconds, usage, finish = await self._call(messages, temperature)
        try:
            scores = parse_scores(text, n)
        except JudgeOutputError as exc:
            self._observe("malformed", seconds, usage)
            if finish == "length":
                raise JudgeOutputError(f"{exc} (cut at judge_max_tokens)") from exc
            raise
        self._observe("ok", seconds, usage)
        return scores

    async def _call(
        self, messages: list[dict[str, str]], temperature: float
    ) -> tuple[str, float, dict[str, Any], str | None]:
        """One chat completion from the judge: (its text, seconds, usage, finish_reason). Raises
        JudgeUnavailable when it cannot answer (counted as an `error` call)."""
        s = self.settings
        base, model, key = self.endpoint()
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=s.judge_timeout)
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": s.judge_max_tokens,
            "temperature": temperature,
        }
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for _ in range(2):  # a second time without response_format if the server refuses it
            if self._json_mode:
                body["response_format"] = {"type": "json_object"}
            else:
                body.pop("response_format", None)
            t0 = time.perf_counter()
            try:
                resp = await self._client.post(f"{base}/chat/completions", json=body, headers=headers)
            except httpx.HTTPError as exc:
                self._observe("error", time.perf_counter() - t0, {})
                why = str(exc) or f"no answer within judge_timeout ({s.judge_timeout:g} s)"
                raise JudgeUnavailable(f"{type(exc).__name__}: {why}") from exc
            seconds = time.perf_counter() - t0
            if resp.status_code == 400 and self._json_mode and "response_format" in resp.text:
                self._json_mode = False
                log.info("judge: the server refuses response_format; asking for JSON in the prompt only")
                continue
            if resp.status_code != 200:
                self._observe("error", seconds, {})
                raise JudgeUnavailable(f"HTTP {resp.status_code}: {resp.text[:200]}")
            try:
                data = resp.json()
                text = data["choices"][0]["message"].get("content") or ""
                finish = data["choices"][0].get("finish_reason")
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                data, text, finish = {}, resp.text, None
            usage = data.get("usage") if isinstance(data, dict) else None
            return str(text), seconds, usage if isinstance(usage, dict) else {}, finish
        raise JudgeUnavailable("the judge refused the request")

    def _group(self, outcome: str) -> None:
        self.stats.groups[outcome] = self.stats.groups.get(outcome, 0) + 1
        if self.on_group is not None:
            self.on_group(outcome)

    def _observe(self, outcome: str, seconds: float, usage: dict[str, Any]) -> None:
        """Count one call: outcome ok, malformed or error, its latency and tokens."""
        p, q = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        st = self.stats
        st.calls[outcome] = st.calls.get(outcome, 0) + 1
        st.seconds += seconds
        st.prompt_tokens += p
        st.completion_tokens += q
        if self.on_call is not None:
            self.on_call(outcome, seconds, p, q)
