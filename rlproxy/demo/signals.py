"""`rlproxy demo --signal ...`, `--siblings`, `--shadow`: where the demo's learning signal comes from
(issue 54), each measured on the same fixed validation prompts (the rungs).

    groups      the app forms groups (`X-Group-Id`, one task per group) and posts every episode's
                reward: today's recipe;
    singletons  every episode's task is its own (demo/tasks.py), no group header, the app posts each
                reward; `serve` runs with `singletons=train` (ungrouped runs train in batches of
                `group_size` against the batch's mean reward), `group_timeout` 5 s;
    scorer      every episode's task is its own, no group header, and the app posts NO reward: the only
                signal is a url scorer, the task's own checker served by the demo over HTTP
                (demo/scorer.py, demo/checkers.py), and `serve` runs with `--siblings new --scorer url
                --scorer-url ...` (siblings_k from serve's default or RLPROXY_SIBLINGS_K).

`--siblings` (off | new | alone | plateau, a comma list, or per policy) and `--shadow N`
(`shadow_prompts`) pass through to `serve`, with `--scorer` (default `url`: the demo's checker;
`checks`: the built-in checks; `judge`). No `--signal`, no `--siblings`, no `--shadow` is today's demo,
run by `run._loop` exactly as before. Everything else runs `signal_loop`: one batch of `group_size`
episodes per row, then it waits until the trainer is done with them (the group, the singletons, or
the sibling groups branched from their calls) and the newest step serves, and every `rung_minutes` it
measures a rung; the stop rule reads the rungs: `goal` once two rungs in a row hold base + the task's
`RUNG_GOAL` (the issue's +0.3 number game, +0.2 directory).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from rlproxy.demo import directory, number_game, store
from rlproxy.demo.episodes import Episode, play_all
from rlproxy.demo.harness import Loop, engine_counters, engine_delta, mean, wait_policy_step, wait_trained
from rlproxy.demo.rungs import evaluate, evaluate_number
from rlproxy.demo.tasks import Task, UniqueTasks, rung_tasks

log = logging.getLogger(__name__)

SIGNALS = ("groups", "singletons", "scorer")
SCORERS = ("url", "checks", "judge")
RUNG_GOAL = {"number": 0.3, "directory": 0.2}  # rung gain over the base rung that counts as learned
RUNG_MINUTES = {"number": 2.0, "directory": 4.0}  # default time between two rungs of the curve
SIBLING_APPEAR_S = 30.0  # how long a batch waits for the sibling groups it should get
SIBLING_WAIT_S = 300.0  # how long a batch waits for its sibling groups to be trained or failed


@dataclass
class SignalPlan:
    """The demo's signal and the siblings settings it gives `serve` (saved in summary.json)."""

    signal: str | None  # None: today's demo (groups, run._loop)
    siblings: str  # serve's `siblings`
    scorer: str | None  # serve's `scorer` (None: serve's default); url = the demo's checker
    shadow: int  # serve's `shadow_prompts`
    rung_minutes: float | None  # minutes between rungs (None: today's rungs only)
    rung_goal: float
    max_steps: int | None = None  # stop once the policy serves this trainer step (a step budget)

    @property
    def legacy(self) -> bool:
        return self.signal is None and self.siblings == "off" and not self.shadow

    @property
    def unique(self) -> bool:
        return self.signal in ("singletons", "scorer")

    def serve_settings(self, score_url: str | None, group_size: int) -> dict[str, Any]:
        """The settings `serve` gets for this plan, by name (what changed_settings shows)."""
        out: dict[str, Any] = {}
        if self.signal == "singletons":
            out |= {"singletons": "train", "singleton_batch": group_size, "group_timeout": 5.0}
        if self.signal == "scorer":
            out |= {"group_timeout": 5.0, "groups_per_step": 4}  # no app groups; sibling groups of K
        if self.siblings != "off":
            out["siblings"] = self.siblings
        if self.shadow:
            out["shadow_prompts"] = self.shadow
        if self.scorer is not None:
            out["scorer"] = self.scorer
        if self.scorer == "url" and score_url:
            out["scorer_url"] = score_url
        return out


def resolve(
    task: str,
    signal: str | None = None,
    siblings: str | None = None,
    scorer: str | None = None,
    shadow: int | None = None,
    rung_minutes: float | None = None,
    max_steps: int | None = None,
) -> SignalPlan:
    """Check the options together and fill in their defaults; ValueError says what does not fit."""
    if signal is not None and signal not in SIGNALS:
        raise ValueError(f"--signal {signal!r}: choose one of {', '.join(SIGNALS)}")
    if scorer is not None and scorer not in SCORERS:
        raise ValueError(f"--scorer {scorer!r}: choose one of {', '.join(SCORERS)}")
    if shadow is not None and shadow < 0:
        raise ValueError("--shadow: a number of prompts >= 0 (0 = off)")
    chosen = (siblings or "").strip()
    if signal == "scorer":
        if chosen == "off":
            raise ValueError("--signal scorer learns only from siblings: --siblings off leaves no signal")
        chosen = chosen or "new"
    chosen = chosen or "off"
    if scorer is not None and chosen == "off" and not shadow:
        raise ValueError("--scorer scores siblings or the shadow check: add --siblings or --shadow")
    if scorer is None and (chosen != "off" or shadow):
        scorer = "url"  # the task's own checker, served by the demo
    if rung_minutes is not None and rung_minutes <= 0:
        raise ValueError("--rung-minutes: a positive number of minutes")
    if max_steps is not None and max_steps < 1:
        raise ValueError("--max-steps: a number of trainer steps >= 1")
    plan = SignalPlan(signal, chosen, scorer, shadow or 0, None, RUNG_GOAL[task], max_steps)
    if max_steps is not None and plan.legacy:
        raise ValueError("--max-steps counts the steps of --signal, --siblings or --shadow: use --max-groups")
    if not plan.legacy:
        plan.rung_minutes = rung_minutes or RUNG_MINUTES[task]
    return plan


def play_batch(
    client: Any,
    agent: Any,
    policy: str,
    specs: list[Task],
    group_id: str | None,
    *,
    base_url: str,
    post: bool,
    temperature: float,
    max_tokens: int,
    seed: int,
) -> list[Episode]:
    """One episode per task, concurrently; each reward posted when `post` (the app's reward)."""

    def one(i: int) -> Episode:
        episode_seed = seed * 1000 + i
        if agent is number_game:
            return number_game.play_episode(client, policy, group_id, temperature, max_tokens, episode_seed,
                                            specs[i]["prompt"])  # fmt: skip
        return directory.play_episode(client, policy, group_id, specs[i]["people"], temperature, max_tokens,
                                      episode_seed, topic=specs[i].get("topic"))  # fmt: skip

    return play_all(len(specs), one, base_url, post=post)


class Curve:
    """The rungs over time: `measure(name)` plays the fixed validation prompts (never trained) with the
    newest policy and appends the rung, with the minutes since the start and the step serving."""

    def __init__(self, task: str, loop: Loop, seed: int, n: int, post: bool) -> None:
        self.task, self.base, self.client, self.policy, self.seed = (
            task,
            loop.base,
            loop.client,
            loop.policy,
            seed,
        )
        self.post, self.started, self.echo = post, loop.started, loop.echo
        self.tasks = rung_tasks(task, seed, n)
        self.rungs: list[dict[str, Any]] = []
        self.last = 0.0

    def measure(self, name: str) -> dict[str, Any]:
        if self.task == "number":
            prompts = [t["prompt"] for t in self.tasks]
            r = evaluate_number(self.client, self.base, self.policy, name, prompts, self.seed, self.echo,
                                post=self.post)  # fmt: skip
        else:
            pairs = [t["people"] for t in self.tasks]
            r = evaluate(
                self.client, self.base, self.policy, name, pairs, self.seed, self.echo, post=self.post
            )
        r["minutes"] = round((time.monotonic() - self.started) / 60, 2)
        r["policy_step"] = (
            httpx.get(f"{self.base}/healthz", timeout=10).json().get("policies", {}).get(self.policy)
        )
        self.rungs.append(r)
        self.last = time.monotonic()
        return r

    def due(self, minutes: float) -> bool:
        return time.monotonic() - self.last >= minutes * 60

    def goal_held(self, goal: float) -> bool:
        """The last two rungs after the base both at least `goal` above it."""
        if len(self.rungs) < 3:
            return False
        floor = self.rungs[0]["mean_reward"] + goal
        return all(r["mean_reward"] >= floor for r in self.rungs[-2:])


def _wait_runs(db: Path, run_ids: list[str], timeout: float) -> dict[str, tuple[str, int | None]]:
    """Wait until the trainer is done with these runs (trained, skipped, failed, expired)."""
    deadline = time.monotonic() + timeout
    while True:
        states = store.run_states(db, run_ids)
        if len(states) == len(run_ids) and all(s in store.FINAL for s, _ in states.values()):
            return states
        if time.monotonic() > deadline:
            log.warning("runs not trained after %.0fs: %s", timeout, sorted(s for s, _ in states.values()))
            return states
        time.sleep(0.3)


def _wait_siblings(db: Path, run_ids: list[str], expect: bool, timeout: float) -> list[dict[str, Any]]:
    """Wait until the sibling groups branched from these runs are done (trained, skipped or failed);
    when `expect`, first up to SIBLING_APPEAR_S for one to appear. Returns them as they stand."""
    started = time.monotonic()
    deadline = started + timeout
    last: list[dict[str, Any]] = []
    while True:
        groups = store.sibling_states(db, run_ids)
        settled = groups and all(g["done"] for g in groups) and len(groups) == len(last)
        if settled or (not groups and (not expect or time.monotonic() - started > SIBLING_APPEAR_S)):
            return groups
        if time.monotonic() > deadline:
            log.warning(
                "%d sibling group(s) not done after %.0fs", sum(not g["done"] for g in groups), timeout
            )
            return groups
        last = groups
        time.sleep(1.0)


def signal_loop(loop: Loop, sig: SignalPlan, curve: Curve) -> str:
    """One batch per row until time, max_groups, max_steps or the rung goal; returns why it stopped."""
    plan, rows, base, client, policy, db = loop.plan, loop.rows, loop.base, loop.client, loop.policy, loop.db
    tasks = UniqueTasks(plan.task, plan.seed, curve.tasks)
    deadline = loop.started + plan.minutes * 60
    with httpx.Client(base_url=base, timeout=30) as http:
        while True:
            if (why := loop.stop(deadline)) is not None:
                return why
            t0, seed = time.monotonic(), plan.seed * 100_000 + len(rows)
            counters = engine_counters(http)
            kw = {"base_url": f"{base}/v1", "temperature": plan.temperature, "max_tokens": plan.max_tokens}
            if sig.signal is None:  # today's groups (their prompts), with siblings or the shadow check
                episodes = loop.group()
            elif sig.signal == "groups":  # one new task per group, shared by its episodes
                spec = tasks.next()
                gid = f"{plan.task[:3]}-{uuid.uuid4().hex[:12]}"
                episodes = play_batch(client, loop.agent, policy, [spec] * plan.group_size, gid, post=True,
                                      seed=seed, **kw)  # fmt: skip
            else:  # a new task per episode, no group header; the scorer signal posts no reward
                specs = [tasks.next() for _ in range(plan.group_size)]
                episodes = play_batch(client, loop.agent, policy, specs, None, seed=seed,
                                      post=sig.signal == "singletons", **kw)  # fmt: skip
            sampled_s = time.monotonic() - t0
            engine = engine_delta(counters, engine_counters(http))
            ids = [e.run_id for e in episodes]
            if sig.signal == "scorer":
                statuses = [store.run_states(db, ids).get(i, ("open", None))[0] for i in ids]
                steps: list[int] = []
            elif sig.unique:
                states = _wait_runs(db, ids, timeout=600)
                statuses = [s for s, _ in states.values()]
                steps = [step for s, step in states.values() if s == "trained" and step]
            else:
                runs = wait_trained(http, episodes[0].group_id, plan.group_size, timeout=600)
                statuses = [r["status"] for r in runs]
                steps = [r["trained_step"] for r in runs if r["status"] == "trained" and r["trained_step"]]
            siblings: list[dict[str, Any]] = []
            if sig.siblings != "off":
                expect = "new" in sig.siblings or ("plateau" in sig.siblings and "skipped" in statuses)
                siblings = _wait_siblings(db, ids, expect, SIBLING_WAIT_S)
                steps += [g["step"] for g in siblings if g["step"]]
            if steps:
                wait_policy_step(http, policy, max(steps))
            status = "trained" if steps else (statuses[0] if statuses else "-")
            row = {
                "group": len(rows) + 1,
                "step": max(steps) if steps else None,
                "mean_reward": mean([e.reward for e in episodes]),  # the task's reward, posted or not
                "posted": sig.signal != "scorer",
                "runs": len(episodes),
                "calls": mean([float(len(e.replies)) for e in episodes]),
                "seconds": round(time.monotonic() - t0, 2),
                "sample_seconds": round(sampled_s, 2),
                "engine": engine,
                "status": status,
                "siblings": {
                    "made": len(siblings),
                    "scored": sum(g["status"] == "scored" for g in siblings),
                    "failed": sum(g["status"] == "failed" for g in siblings),
                    "trained": sum(bool(g["step"]) for g in siblings),
                },
                "example": episodes[0].replies,
            }
            rows.append(row)
            sib = row["siblings"]
            loop.echo(
                f"group {row['group']:3d}  step {row['step'] or '-':>3}  reward {row['mean_reward']:.3f}  "
                f"{status:8s} siblings {sib['made']} made, {sib['trained']} trained  {row['seconds']:5.1f}s  "
                f"{time.monotonic() - loop.started:6.0f}s total  e.g. {row['example']!r}"
            )
            if sig.rung_minutes is not None and curve.due(sig.rung_minutes):
                curve.measure(f"g{row['group']}")
                if curve.goal_held(sig.rung_goal):
                    return "goal"
            if sig.max_steps is not None and (row["step"] or 0) >= sig.max_steps:
                return "max_steps"  # the final rung is measured at this step


def report(
    sig: SignalPlan, db: Path, rungs: list[dict[str, Any]], scorer: Any, echo: Callable[[str], None]
) -> dict[str, Any]:
    """summary.json's `signal`, `rungs`, `siblings` (SQL: demo/store.py) and `scorer`, and their table."""
    tally = store.siblings_summary(db)
    out: dict[str, Any] = {
        "signal": asdict(sig),
        "rungs": [{k: v for k, v in r.items() if k != "example"} for r in rungs],
        "rung_gain": round(rungs[-1]["mean_reward"] - rungs[0]["mean_reward"], 4) if len(rungs) > 1 else None,
        "siblings": tally,
        "scorer": scorer.scorer.stats() if scorer is not None else None,
    }
    echo("")
    echo(f"{'rung':>6}  {'minutes':>7}  {'step':>4}  {'reward':>6}")
    for r in rungs:
        step = "-" if r.get("policy_step") is None else r["policy_step"]
        echo(f"{r['rung']:>6}  {r['minutes']:>7.1f}  {step:>4}  {r['mean_reward']:>6.3f}")
    if out["rung_gain"] is not None:
        first, last = rungs[0]["mean_reward"], rungs[-1]["mean_reward"]
        n = rungs[0]["episodes"]
        echo(f"rungs: {first:.3f} -> {last:.3f} ({out['rung_gain']:+.3f}) on {n} fixed validation prompts")
    sib, app = tally["sibling_groups"], tally["app_groups"]
    echo(
        f"sibling groups: {sib['made']} made, {sib['scored']} scored, {sib['failed']} failed, "
        f"{sib['trained']} trained, {sib['skipped']} skipped; app groups: {app['trained']} trained, "
        f"{app['skipped_zero_variance']} skipped (zero variance), {app['rescued_by_siblings']} of those "
        "rescued by siblings"
    )
    if out["scorer"] is not None:
        c = out["scorer"]
        echo(f"the demo's scorer: {c['calls']} calls, {c['candidates']} candidates, {c['errors']} errors")
    return out
