"""What the trainer does about canary rollouts (issue 28; docs/rollout.md "Training meanwhile").

The trainer (the fleet's leader: one per store) opens, judges and cleans up rollouts; proxies only
route (proxy/rollout.py). In `TrainerService`:

- publish: after the adapter is loaded and before the step commits, `begin` opens the rollout of a
  canary policy's new step (`abort` removes it when the commit loses: StepConflict). The incumbent's
  checkpoint and adapter are protected from pruning and unloading while it is open (`protect`).
- every poll (`tick`): each open rollout's arms go through the rule (storage/rollout_rule.py); one
  look, one decision, written conditionally (storage/rollouts.py). A policy with an open rollout does
  not train: its next step waits for the verdict, so it is built from the step that won — the
  candidate once promoted, the incumbent after a rollback — never from a step on trial.
- a rolled-back step (by the rule or by `rlproxy rollout rollback`, from any process): its checkpoint
  is deleted and its `adapter_path` set NULL (so no restart re-loads it and no learner resumes from
  it), its adapter is unloaded after `unload_grace`, and a learner holding its weights is dropped:
  the next step reloads the incumbent's checkpoint (weights and optimizer) and gets the next free
  step number.
- runs sampled by a rejected step are real rewards and stay trainable like any run: the loss's
  importance ratio is taken against the logprobs stored with each call (the step that sampled it),
  clipped and capped as for any off-policy sample (their lag is negative: sampled by a newer step).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rlproxy.settings import parse_rollout
from rlproxy.storage import rollouts as store
from rlproxy.storage.rollout_rule import RuleConfig, decide, mode_of

log = logging.getLogger(__name__)


class RolloutController:
    """Opens, judges and cleans up the canary rollouts of the policies in canary mode."""

    def __init__(self, modes: str | dict[str, str], fraction: float, rule: RuleConfig) -> None:
        self.modes = parse_rollout(modes) if isinstance(modes, str) else modes
        self.fraction = fraction
        self.rule = rule
        self._last: dict[int, tuple[Any, ...]] = {}  # rollout id -> numbers last written (skip no-ops)
        self.decisions: list[tuple[str, int, str]] = []  # (policy, step, decision) taken here, newest last
        # called after this process decided a rollout (compose.py: the in-process router re-reads at once;
        # other replicas see it within policy_poll_interval)
        self.on_decision: Callable[[], Awaitable[None]] | None = None

    def canary(self, policy: str) -> bool:
        """Whether `policy` rolls out its new steps by canary."""
        return mode_of(self.modes, policy) == "canary"

    async def begin(self, engine: Any, policy: str, step: int) -> int | None:
        """Open the rollout of `policy@step` if the policy is in canary mode; the id when this call
        inserted it (so that `abort` removes only its own row)."""
        if not self.canary(policy):
            return None
        rid, inserted = await store.begin(engine, policy, step, self.fraction)
        if inserted:
            log.info("canary: %s@%d serves %.0f%% of new runs", policy, step, 100 * self.fraction)
        return rid if inserted else None

    async def abort(self, engine: Any, rollout_id: int | None) -> None:
        """The step of this rollout never committed: remove the row."""
        if rollout_id is not None:
            await store.abort(engine, rollout_id)

    async def protect(self, engine: Any, policy: str) -> tuple[int, ...]:
        """Steps of `policy` that must stay on disk and loaded: the incumbents of its open rollouts."""
        snap = (await store.snapshot(engine)).get(policy)
        if snap is None:
            return ()
        keep = {snap.stable}
        if snap.open is not None:
            keep |= {snap.open.incumbent, snap.open.candidate}
        return tuple(s for s in keep if s > 0)

    async def tick(self, service: Any) -> set[str]:
        """Judge every open rollout, clean up rolled-back steps; the policies whose rollout is still open."""
        engine = service._db()
        still_open: set[str] = set()
        for row in await store.open_rollouts(engine):
            cand, inc = await store.arm_runs(engine, row["id"])
            verdict = decide(cand, inc, row["looks"], self.rule)
            key = (verdict.look, verdict.decision, tuple(sorted(verdict.stats.items())))
            if self._last.get(row["id"]) != key:
                self._last[row["id"]] = key
                won = await store.record_look(engine, row["id"], verdict, row["looks"])
                if won and verdict.decision != "continue":
                    self.decisions.append((row["policy"], row["candidate_step"], verdict.decision))
                    log.info(
                        "canary %s@%d vs @%d: %s (%s)",
                        row["policy"],
                        row["candidate_step"],
                        row["incumbent_step"],
                        verdict.decision,
                        verdict.reason,
                    )
                    if self.on_decision is not None:
                        await self.on_decision()
            if verdict.decision == "continue":
                still_open.add(row["policy"])
        await self.clean(service)
        return still_open

    async def clean(self, service: Any) -> list[tuple[str, int]]:
        """Delete what rolled-back steps left: the service's `discard_rolled_back` (checkpoints, paths,
        a learner holding their weights, adapters)."""
        return await service.discard_rolled_back()


def controller_from(settings: Any) -> RolloutController | None:
    """The controller for these settings (a Settings object), or None when no policy is in canary mode."""
    modes = parse_rollout(settings.rollout)
    if "canary" not in modes.values():
        return None
    rule = RuleConfig(
        min_runs=settings.canary_min_runs,
        looks=settings.canary_looks,
        alpha=settings.canary_alpha,
        min_pairs=settings.canary_min_pairs,
        error_margin=settings.canary_error_margin,
        inconclusive=settings.canary_inconclusive,
        max_key_share=settings.canary_max_key_share,
    )
    return RolloutController(modes, settings.canary_fraction, rule)
