"""Which runs the next step trains: ready groups of one policy, read with their completions.

    lone runs past group_timeout -> `ungrouped` ──> (the judge scores the groups waiting for it)
    ──> ready groups; zero-variance ones skipped ──> up to groups_per_step of one policy, or a batch
    of ungrouped runs (singletons=train) ──> their completions; hosted or unusable runs set aside

The trainer's service (service.py) asks `runs()` once per poll; what the selection skipped since the
last committed step goes into that step's metrics (`metrics`, `hosted_since`), then `stepped()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from rlproxy.storage.models import RunStatus
from rlproxy.storage.overview import fullest_waiting_group
from rlproxy.storage.queries import run_status_counts
from rlproxy.storage.training import (
    ReadyGroup,
    RunData,
    StatusReason,
    load_runs,
    mark_runs,
    ready_groups,
    singleton_notice,
    skip_groups,
    ungroup_runs,
    ungrouped_batch,
)
from rlproxy.trainer.batches import usable
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.step import StepResult

log = logging.getLogger(__name__)

NOTICE_EVERY = 3600.0  # seconds between two warnings that most rewarded runs are ungrouped
NOTICE_CHECK_EVERY = 60.0  # seconds between two counts of runs per status for that warning


class Selection:
    """Picks the next step's runs from the store (`db`: the service's engine, made on first use)."""

    def __init__(
        self, config: TrainerConfig, db: Callable[[], Any], judge: Any = None, siblings_weight: float = 1.0
    ) -> None:
        self.config, self.db, self.judge = config, db, judge
        self.siblings_weight = siblings_weight  # a sibling group's runs' weight in a step (docs/siblings.md)
        self._next_notice = 0.0  # time.monotonic() before which the singletons warning stays quiet
        self.flat_groups = 0  # zero-variance groups skipped since the last committed step
        self.hosted_skipped = 0  # runs a hosted upstream answered, skipped (never GRPO samples), in all
        self.hosted_since = 0  # ... since the last committed step (its data/hosted_runs_skipped)
        self._waiting_for: tuple[str, str, int] | None = None  # the fullest waiting group, logged on change

    def stepped(self) -> None:
        """A step committed: what was skipped before it is in its metrics."""
        self.flat_groups = self.hosted_since = 0

    async def runs(self) -> list[RunData]:
        """The runs of the next step with their completions; runs with nothing usable become `failed`."""
        while groups := await self._groups():
            runs = await load_runs(self.db(), [rid for g in groups for rid in g.run_ids])
            hosted = [
                r.run_id for r in runs if r.completions and all(c.source == "hosted" for c in r.completions)
            ]
            if (
                hosted
            ):  # a hosted provider's text: SFT/distillation data (rlproxy sft --from-policy), not GRPO
                n = await mark_runs(self.db(), hosted, RunStatus.skipped, StatusReason.hosted)
                self.hosted_skipped += n
                self.hosted_since += n  # in the next step's metrics: data/hosted_runs_skipped
                log.info(
                    "skipped %d run(s) answered by a hosted upstream (no token ids: not GRPO samples; "
                    "distill them with `rlproxy sft --from-policy`)",
                    n,
                )
                runs = [r for r in runs if r.run_id not in set(hosted)]
                if not runs:
                    continue
            empty = [r.run_id for r in runs if not any(usable(c) for c in r.completions)]
            if not empty:
                for r in runs:
                    r.weight = self.siblings_weight if r.sibling else 1.0
                return runs
            # rewarded, but nothing sampled was stored (errors only, or no completion): never trainable;
            # select again, so the groups' readiness and variance are judged without them
            await mark_runs(self.db(), empty, RunStatus.failed, StatusReason.no_usable_completion)
            log.warning("marked %d run(s) failed: no usable completion stored", len(empty))
        return []

    async def _groups(self) -> list[ReadyGroup]:
        cfg = self.config
        # runs alone in their group past group_timeout leave `completed` first (status ungrouped), so
        # the reads below only ever see runs younger than a timeout and groups waiting for a step
        await self.ungroup()
        if self.judge is not None:  # rewards from the judge first: its groups then select like any other
            await self.judge.judge_ready(
                self.db(), group_size=cfg.group_size, group_timeout=cfg.group_timeout
            )
        groups = await ready_groups(self.db(), group_size=cfg.group_size, group_timeout=cfg.group_timeout)
        if self.judge is not None:  # judge=always: app rewards wait until the judge has scored them
            groups = [g for g in groups if not self.judge.needs_judge(g.policy, g.sources)]
        flat = [g for g in groups if g.zero_variance]
        if flat:
            self.flat_groups += len(flat)  # counted in the next step's zero_variance_frac
            n = await skip_groups(self.db(), flat)
            log.info(
                "skipped %d zero-variance group(s) (%d runs): equal rewards carry no gradient", len(flat), n
            )
        groups = [g for g in groups if not g.zero_variance]
        if not groups:
            await self._say_what_we_wait_for()
            return await self._ungrouped_batch()
        mine = [g for g in groups if g.policy == groups[0].policy]
        waited = (datetime.now(UTC) - mine[0].newest_at).total_seconds()
        if len(mine) < cfg.groups_per_step and waited < cfg.group_timeout:
            return await self._ungrouped_batch()  # wait for a full step, but not forever
        return mine[: cfg.groups_per_step]

    async def _say_what_we_wait_for(self) -> None:
        """One log line each time the fullest waiting group changes: "waiting: group 3/8 of g-..."."""
        found = await fullest_waiting_group(self.db())
        if found is not None and found != self._waiting_for:
            policy, group, n = found
            log.info(
                "waiting for rewarded runs: group %d/%d of %s (policy %s)",
                n,
                self.config.group_size,
                group,
                policy,
            )
        self._waiting_for = found

    async def ungroup(self) -> None:
        n = await ungroup_runs(self.db(), group_timeout=self.config.group_timeout)
        if n:
            log.info(
                "%d run(s) ungrouped: no other run of their group within group_timeout (%.0f s); %s",
                n,
                self.config.group_timeout,
                "they train in batches" if self.config.singletons == "train" else "not trained",
            )
            await self.warn_singletons()

    async def warn_singletons(self) -> None:
        """Warn (at most every NOTICE_EVERY seconds) when most rewarded runs are ungrouped, saying what
        to set; not with singletons=train, which trains them."""
        now = time.monotonic()
        if self.config.singletons == "train" or now < self._next_notice:
            return
        self._next_notice = now + NOTICE_CHECK_EVERY  # counting every run's status is not free
        notice = singleton_notice(await run_status_counts(self.db()))
        if notice:
            self._next_notice = now + NOTICE_EVERY
            log.warning(notice)

    async def _ungrouped_batch(self) -> list[ReadyGroup]:
        """singletons=train: the next batch of ungrouped runs, trained against its own mean reward."""
        cfg = self.config
        if cfg.singletons != "train":
            return []
        # full batches first; a short one once its newest run has sat ungrouped another group_timeout
        batch = await ungrouped_batch(self.db(), batch_size=cfg.singleton_batch, wait=2 * cfg.group_timeout)
        if batch is None:
            return []
        if batch.zero_variance:
            self.flat_groups += 1  # counted in the next step's zero_variance_frac, like a flat group
            n = await skip_groups(self.db(), [batch])
            log.info("skipped a batch of %d ungrouped run(s): equal rewards carry no gradient", n)
            return []
        return [batch]

    def metrics(self, r: StepResult) -> dict[str, float]:
        """What only the selection knows: the zero-variance groups it skipped since the last step.

        zero_variance_frac = (skipped groups + this step's equal-reward groups) / (skipped + this step's).
        """
        flat_here = r.metrics.get("reward/frac_zero_std", 0.0) * r.num_groups
        seen = self.flat_groups + r.num_groups
        return {
            "reward/groups_skipped": float(self.flat_groups),
            "reward/zero_variance_frac": (self.flat_groups + flat_here) / seen if seen else 0.0,
        }
