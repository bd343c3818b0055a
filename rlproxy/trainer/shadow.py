"""The shadow check (issue 54): a new step answers recent stored prompts beside the serving step before
it serves anyone; it goes live only when it does not lose by more than `shadow_margin`.

In `TrainerService._publish`, after the candidate's adapter is loaded into the backend and before
its step commits (so before the alias flips in `immediate` mode, before a canary opens in `canary`):

    recent stored prompts not trained on (storage/shadow.py), up to shadow_prompts, newest first
      ──> per prompt, one seed: one answer of `policy@candidate`, one of the serving step (resample.py;
          the stored request's max_tokens, temperature, top_p, stop; low priority; straight to the
          engine, never captured)
      ──> the configured scorer scores each pair (scorers.py; the order alternates by prompt, so a
          judge's position bias cancels out)
      ──> decide(): passed when mean(candidate) - mean(serving) >= -margin

- passed: the step commits and goes live as without a check (canary: its canary opens).
- failed: the step commits with a `rollouts` row `rolled_back`, reason "shadow: ...": it never serves,
  its checkpoint is deleted and its adapter unloaded, the next step is built from the serving step's
  checkpoint (what a canary's rollback does: TrainerService.discard_rolled_back).
- fewer than 2 prompts: `skipped`, the step goes live unchecked (a fresh store has nothing to ask).
- the scorer or the engine failed: `error`, and the step waits (not committed, not served); the
  next poll tries again, no sooner than `scorer_timeout` seconds later; after `scorer_max_attempts`
  failed tries it is rolled back ("shadow: no verdict ..."): a step nobody checked never serves.

Each check is one `shadow_checks` row: running -> passed | failed | skipped | error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rlproxy.errors import RLProxyError
from rlproxy.inference.backend import adapter_name
from rlproxy.storage import shadow as store
from rlproxy.trainer.resample import SIBLING_PRIORITY, ResampleError, as_message, sample
from rlproxy.trainer.scorers import Scorer, ScoreRequest, ScorerError

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # a stored request that named no max_tokens
TIE = 1e-9  # float slack at the margin: a candidate that loses by exactly the margin passes


class ShadowPending(RLProxyError):
    """The check had no verdict this time (scorer or engine failed): the step waits for the next poll."""


@dataclass(frozen=True)
class Verdict:
    """The decision rule's outcome on a list of (candidate, serving) scores."""

    passed: bool
    candidate: float  # mean score of the candidate
    serving: float  # mean score of the serving step
    reason: str


def decide(pairs: Sequence[tuple[float, float]], margin: float) -> Verdict:
    """Passed when mean(candidate) - mean(serving) >= -margin (a loss of exactly the margin passes)."""
    if not pairs:
        raise ValueError("decide needs at least one pair")
    c = sum(p[0] for p in pairs) / len(pairs)
    s = sum(p[1] for p in pairs) / len(pairs)
    passed = c - s >= -margin - TIE
    sign = ">=" if passed else "<"
    reason = (
        f"candidate {c:.3f} vs serving {s:.3f} on {len(pairs)} prompts: "
        f"{c - s:+.3f} {sign} -{margin:g} (margin)"
    )
    return Verdict(passed, c, s, reason)


@dataclass(frozen=True)
class Outcome:
    """What the check says about a step: `status` passed, failed, skipped or error (no verdict)."""

    status: str
    reason: str
    serving_step: int

    @property
    def serves(self) -> bool:
        """Whether the step may go live (passed, or unchecked for want of prompts)."""
        return self.status in ("passed", "skipped")


def _sampling(request: dict[str, Any]) -> dict[str, Any]:
    """The stored request's sampling parameters, as `resample.sample` takes them."""

    def number(key: str, default: float) -> float:
        v = request.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default

    cap = next(
        (
            request[k]
            for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")
            if isinstance(request.get(k), int) and request[k] > 0
        ),
        DEFAULT_MAX_TOKENS,
    )
    stop = request.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    stops = [x for x in stops if isinstance(x, str)]
    return {
        "max_tokens": int(cap),
        "temperature": number("temperature", 1.0),
        "top_p": number("top_p", 1.0),
        "stop": stops or None,
    }


class ShadowChecker:
    """Runs the shadow check of a new step (see the module doc); one per trainer."""

    def __init__(
        self,
        *,
        prompts: int,
        margin: float,
        make_scorer: Callable[[httpx.AsyncClient], Scorer],
        resolve: Callable[[], tuple[str, str, str | None]],
        max_attempts: int = 3,
        retry_after: float = 30.0,
        timeout: float = 300.0,
    ) -> None:
        self.prompts = prompts
        self.margin = margin
        self.make_scorer = make_scorer
        self.resolve = resolve  # () -> (engine base URL, served base model, engine key): known once started
        self.max_attempts = max_attempts
        self.retry_after = retry_after
        self.timeout = timeout  # seconds one sampling request may take
        self._client: httpx.AsyncClient | None = None
        self._scorer: Scorer | None = None
        self._failures: dict[tuple[str, int], tuple[int, float]] = {}  # (policy, step) -> (tries, retry at)

    def retry_in(self, policy: str, step: int) -> float:
        """Seconds before the check of `policy@step` may be tried again (0: now)."""
        _, at = self._failures.get((policy, step), (0, 0.0))
        return max(0.0, at - time.monotonic())

    def settled(self, policy: str, pending: int | None) -> None:
        """Forget the failed tries of the steps of `policy` but `pending` (its newest checkpoint, not
        committed): the others were committed elsewhere or discarded, no check of theirs is waiting."""
        for key in [k for k in self._failures if k[0] == policy and k[1] != pending]:
            del self._failures[key]

    def waiting(self, policy: str) -> bool:
        """Whether a step of `policy` waits for its check (no verdict yet): the policy does not train."""
        return any(p == policy for p, _ in self._failures)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def check(self, engine: Any, policy: str, step: int, exclude_runs: Sequence[str]) -> Outcome:
        """Check `policy@step` (its adapter loaded); raises ShadowPending while it has no verdict."""
        found = await store.get_check(engine, policy, step)
        if found is not None and found["status"] in store.FINAL:  # decided before a restart: it stands
            return Outcome(found["status"], found["reason"] or "", int(found["serving_step"]))
        key = (policy, step)
        tries, _ = self._failures.get(key, (0, 0.0))
        if wait := self.retry_in(policy, step):
            raise ShadowPending(f"{policy}@{step}: its shadow check is tried again in {wait:.0f} s")
        if self._client is None:
            self._client = httpx.AsyncClient()
            self._scorer = self.make_scorer(self._client)
        assert self._scorer is not None
        serving = await store.serving_step(engine, policy, step)
        check_id = await store.start_check(
            engine, policy=policy, step=step, serving=serving, margin=self.margin, scorer=self._scorer.name
        )
        prompts = await store.recent_prompts(engine, policy, self.prompts, exclude_runs)
        if len(prompts) < 2:
            reason = (
                f"skipped: {len(prompts)} stored prompt(s) of {policy} not trained on (2 needed); "
                "the step goes live unchecked"
            )
            await store.finish_check(engine, check_id, status="skipped", reason=reason, prompts=len(prompts))
            log.warning("shadow check of %s@%d %s", policy, step, reason)
            self._failures.pop(key, None)
            return Outcome("skipped", reason, serving)
        try:
            pairs = await self._pairs(policy, step, serving, prompts)
        except (ScorerError, ResampleError) as exc:
            tries += 1
            if tries >= self.max_attempts:
                self._failures.pop(key, None)
                reason = f"no verdict after {tries} attempt(s): {exc}; the step never serves"
                n = len(prompts)
                await store.finish_check(engine, check_id, status="error", reason=reason, prompts=n)
                log.warning("shadow check of %s@%d: %s", policy, step, reason)
                return Outcome("error", reason, serving)
            self._failures[key] = (tries, time.monotonic() + self.retry_after)
            reason = (
                f"attempt {tries} of {self.max_attempts} failed: {exc}; the step waits, "
                f"tried again in {self.retry_after:g} s"
            )
            await store.finish_check(engine, check_id, status="error", reason=reason, prompts=len(prompts))
            raise ShadowPending(f"{policy}@{step}: {reason}") from exc
        self._failures.pop(key, None)
        verdict = decide([(p["candidate"], p["serving"]) for p in pairs], self.margin)
        status = "passed" if verdict.passed else "failed"
        await store.finish_check(
            engine,
            check_id,
            status=status,
            reason=verdict.reason,
            prompts=len(pairs),
            candidate_score=verdict.candidate,
            serving_score=verdict.serving,
            pairs=pairs,
        )
        log.info("shadow check of %s@%d vs @%d: %s (%s)", policy, step, serving, status, verdict.reason)
        return Outcome(status, verdict.reason, serving)

    async def _pairs(
        self, policy: str, step: int, serving: int, prompts: list[store.StoredPrompt]
    ) -> list[dict[str, Any]]:
        """Score one answer of each step per prompt: [{"completion_id", "candidate", "serving"}]."""
        assert self._client is not None and self._scorer is not None
        url, base_model, key = self.resolve()
        models = (adapter_name(policy, step), adapter_name(policy, serving) if serving > 0 else base_model)
        out = []
        for i, p in enumerate(prompts):
            params = _sampling(p.request)
            answers = await asyncio.gather(
                *(
                    sample(
                        self._client,
                        url,
                        model=m,
                        prompt_ids=p.prompt_ids,
                        n=1,
                        seed=p.completion_id,  # the same seed for both steps: only the weights differ
                        api_key=key,
                        priority=SIBLING_PRIORITY,
                        timeout=self.timeout,
                        **params,
                    )
                    for m in models
                )
            )
            msgs = [as_message(a[0].text, a[0].finish_reason) for a in answers]
            flip = i % 2 == 1  # the serving step's answer first on every other prompt
            req = ScoreRequest(
                group_id=f"shadow:{policy}@{step}:{p.completion_id}",
                policy=policy,
                endpoint=p.endpoint,
                request=p.request,
                candidates=msgs[::-1] if flip else msgs,
            )
            scores = await self._scorer.score(req)
            if len(scores) != 2 or not all(isinstance(x, int | float) and math.isfinite(x) for x in scores):
                raise ScorerError(f"the scorer answered {scores!r} for 2 candidates")
            cand, serv = (scores[1], scores[0]) if flip else (scores[0], scores[1])
            out.append({"completion_id": p.completion_id, "candidate": float(cand), "serving": float(serv)})
        return out
