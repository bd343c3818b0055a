"""What the trainer does about canary rollouts (issue 28; docs/rollout.md "Training meanwhile").

The trainer (the fleet's leader: one per store) opens, judges and cleans up rollouts; proxies only
route (proxy/rollout.py). In `TrainerService`:

- publish: after the adapter is loaded and before the step commits, `begin` opens the rollout of a
  canary policy's new step (`abort` removes it when the commit loses: StepConflict). The incumbent's
  checkpoint and adapter are protected from pruning and unloading while it is open (`protect`).
- every poll (`tick`): each open rollout's arms go through the rule (trainer/rollout_rule.py); one
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
from typing import Any, Protocol

from rlproxy.settings import RolloutSettings, parse_rollout
from rlproxy.storage import rollouts as store
from rlproxy.storage.rollouts import mode_of
from rlproxy.trainer.rollout_rule import decide

log = logging.getLogger(__name__)


class Trainer(Protocol):
    """What the canary needs of the trainer (TrainerService): its store, and the clean-up of the
    steps a decision rolled back (checkpoints, paths, a learner on their weights, adapters)."""

    def db(self) -> Any: ...

    async def discard_rolled_back(self) -> list[tuple[str, int]]: ...


class RolloutController:
    """Opens, judges and cleans up the canary rollouts of the policies in canary mode."""

    def __init__(self, rule: RolloutSettings) -> None:
        self.modes = parse_rollout(rule.rollout)
        self.fraction = rule.canary_fraction
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

    async def tick(self, trainer: Trainer) -> set[str]:
        """Judge every open rollout, clean up rolled-back steps; the policies whose rollout is still open."""
        engine = trainer.db()
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
        await trainer.discard_rolled_back()
        return still_open


def controller_from(settings: Any) -> RolloutController | None:
    """The controller for these settings (a Settings object), or None when no policy is in canary mode."""
    rule = settings.group(RolloutSettings)
    return RolloutController(rule) if "canary" in parse_rollout(rule.rollout).values() else None
