"""Canary routing: which step serves a run of a policy in `rollout = canary` (issue 28; docs/rollout.md).

`Policies.resolve` asks `Router.route(policy, step, run_id)` once it knows the policy's newest loaded
step. For a canary policy with an open rollout (candidate C, incumbent I, fraction f):

- a run this replica served before the rollout began (a bounded memory of run id -> step) stays on
  the step it had, or I if that step is gone: every turn of a run on one step;
- any other run goes to C when `assign(rollout id, run id) < f`, else to I: a pure function of the
  run id and the rollout row, so every proxy replica serves the same split without talking;
- a request without a run id (untagged: never trained, never counted) gets I.

Outside a canary the policy serves its `stable` step: the newest step that was not rolled back (a
run that was on the incumbent when its candidate was promoted finishes on the incumbent). A
rolled-back step is never served by its policy name (a `policy@step` pin still names it; its adapter
is unloaded and its checkpoint deleted by the trainer). A canary policy's step newer than the last
snapshot waits for the next one (<= `policy_poll_interval`): the trainer opens a rollout row before it
commits a step, and `snapshot` reads both in one transaction, so a step it sees has its row.

A policy in `immediate` mode is routed as before (the newest step), except that a rolled-back step
of an earlier canary is still never served. The router is also a Prometheus collector (its gauges
join `/metrics` through `Metrics.registry`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rlproxy.errors import RLProxyError
from rlproxy.inference.backend import adapter_name
from rlproxy.storage import rollouts as store

logger = logging.getLogger(__name__)

NO_STEPS = store.PolicyRollouts(max_step=0)  # a policy without steps: the base model serves
SEEN_MAX = 200_000  # run ids remembered (~100 bytes each): runs older than that many newer ones are forgotten


def assign(rollout_id: int, run_id: str, fraction: float) -> bool:
    """True when run `run_id` belongs to the candidate arm of rollout `rollout_id` (uniform in run ids)."""
    h = hashlib.blake2b(f"{rollout_id}:{run_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64 < fraction


class Router:
    """Routes the runs of canary policies between candidate and incumbent (see the module doc)."""

    def __init__(self, modes: dict[str, str]) -> None:
        self.modes = modes
        self.snap: dict[str, store.PolicyRollouts] = {}
        self.rows: list[dict[str, Any]] = []  # open and recent rollouts, for /metrics
        self._seen: OrderedDict[str, int] = OrderedDict()
        self.assigned: dict[tuple[str, str], int] = {}  # (policy, arm) -> runs given an arm here

    def canary(self, policy: str) -> bool:
        """Whether `policy` rolls out new steps by canary."""
        return store.mode_of(self.modes, policy) == "canary"

    def route(self, policy: str, step: int, run_id: str | None) -> int:
        """The step that serves this request of `policy`, whose newest loaded step is `step`."""
        p = self.snap.get(policy)
        if not self.canary(policy):
            return p.stable if p is not None and step in p.rejected else step
        if p is None:  # no step in the last snapshot: a step published since waits for the next one
            p = NO_STEPS
        o = p.open
        if o is not None and step >= o.candidate:
            served = self._arm(policy, o, run_id)
        elif step in p.rejected or step > p.max_step:
            served = min(p.stable, step)
        else:
            served = step
            prev = self._seen.get(run_id) if run_id is not None else None
            if prev is not None and prev == p.previous and prev != served:
                served = prev  # a run on the incumbent when the candidate was promoted finishes there
        if run_id is not None:
            self._remember(run_id, served)
        return served

    def _arm(self, policy: str, o: store.OpenRollout, run_id: str | None) -> int:
        if run_id is None:
            return o.incumbent
        prev = self._seen.get(run_id)
        if prev is not None:  # a run keeps its step (one that began before the rollout: the incumbent)
            return o.candidate if prev == o.candidate else o.incumbent
        arm = "candidate" if assign(o.id, run_id, o.fraction) else "incumbent"
        self.assigned[(policy, arm)] = self.assigned.get((policy, arm), 0) + 1
        return o.candidate if arm == "candidate" else o.incumbent

    def _remember(self, run_id: str, step: int) -> None:
        seen = self._seen
        if run_id in seen:
            seen.move_to_end(run_id)
        seen[run_id] = step
        if len(seen) > SEEN_MAX:
            seen.popitem(last=False)

    async def refresh(self, engine: Any) -> None:
        """Read the rollouts of every policy (one consistent snapshot)."""
        self.snap = await store.snapshot(engine)
        self.rows = await store.list_rollouts(engine, limit=50)

    async def load_arms(self, engine: Any, backend: Any) -> None:
        """Load both arms' adapters of every open rollout into `backend` (a restarted replica re-loads
        only each policy's newest adapter; the incumbent must serve too)."""
        for policy, p in self.snap.items():
            if p.open is None:
                continue
            steps = [s for s in (p.open.incumbent, p.open.candidate) if s > 0]
            for step, path in (await store.step_paths(engine, policy, steps)).items():
                try:
                    await backend.load_adapter(adapter_name(policy, step), path)
                except (RLProxyError, OSError) as exc:
                    logger.warning("rollout: could not load %s@%d from %s: %s", policy, step, path, exc)

    async def poll(self, engine: Any, interval: float) -> None:
        """Forever, every `interval` seconds: refresh (a lifespan task)."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh(engine)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a locked or briefly unreachable DB must not end the poll
                logger.debug("rollout poll failed: %s", exc)

    # ------------------------------------------------------------------ /metrics

    def collect(self) -> list[Any]:
        """Prometheus: per policy, the open canary's steps, fraction and arms (0 fraction: none open)."""
        fraction = GaugeMetricFamily(
            "rlproxy_rollout_fraction",
            "share of new runs the open canary's candidate serves",
            labels=["policy"],
        )
        step = GaugeMetricFamily(
            "rlproxy_rollout_step", "step of each arm of the open canary", labels=["policy", "arm"]
        )
        runs = GaugeMetricFamily(
            "rlproxy_rollout_arm_runs", "rewarded runs of each arm at the last look", labels=["policy", "arm"]
        )
        reward = GaugeMetricFamily(
            "rlproxy_rollout_arm_reward", "mean reward of each arm at the last look", labels=["policy", "arm"]
        )
        decided = CounterMetricFamily(
            "rlproxy_rollout_decisions", "closed rollouts by outcome", labels=["policy", "status"]
        )
        assigned = CounterMetricFamily(
            "rlproxy_rollout_assigned_runs", "new runs this replica gave each arm", labels=["policy", "arm"]
        )
        counts: dict[tuple[str, str], int] = {}
        for row in self.rows:
            if row["status"] != "canary":
                key = (row["policy"], row["status"])
                counts[key] = counts.get(key, 0) + 1
        for (policy, status), n in counts.items():
            decided.add_metric([policy, status], float(n))
        for policy, p in self.snap.items():
            o = p.open
            fraction.add_metric([policy], o.fraction if o is not None else 0.0)
            if o is None:
                continue
            step.add_metric([policy, "candidate"], float(o.candidate))
            step.add_metric([policy, "incumbent"], float(o.incumbent))
            row = next((r for r in self.rows if r["id"] == o.id), None)
            for arm in ("candidate", "incumbent"):
                if row is not None and row.get(f"{arm}_runs") is not None:
                    runs.add_metric([policy, arm], float(row[f"{arm}_runs"]))
                if row is not None and row.get(f"{arm}_reward") is not None:
                    reward.add_metric([policy, arm], float(row[f"{arm}_reward"]))
        for (policy, arm), n in self.assigned.items():
            assigned.add_metric([policy, arm], float(n))
        return [fraction, step, runs, reward, decided, assigned]


class RolloutService:
    """The router's lifespan part: a first snapshot (and both arms loaded) before serving, then a poll."""

    def __init__(self, router: Router, state: Any, interval: float) -> None:
        self.router, self.state, self.interval = router, state, interval
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        engine = self.state.engine
        await self.router.refresh(engine)
        await self.router.load_arms(engine, self.state.backend)
        self._task = asyncio.create_task(self.router.poll(engine, self.interval), name="rlproxy-rollout-poll")

    async def refresh(self) -> None:
        """Read the rollouts now (the in-process trainer calls this after each decision)."""
        await self.router.refresh(self.state.engine)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # until it has ended (its CancelledError stays in it)
            self._task = None
