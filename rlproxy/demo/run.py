"""`rlproxy demo`: the whole loop on a laptop CPU, from an unmodified agent to a better model.

What it does, in order:
  1. starts `rlproxy serve` as a subprocess (exactly what a user runs): the embedded engine with
     SmolLM2-135M-Instruct, SQLite in `out_dir`, the trainer on; its peak memory is sampled;
  2. runs a task's agent against it, one group of episodes at a time (the episodes of a group run
     concurrently): `number` (`demo/number_game.py`, two turns) or `directory` (`demo/directory.py`,
     a tool-using agent: lookups over a small table, then an answer), plain OpenAI-SDK programs
     (also under `examples/`);
  3. after each group waits until the trainer has trained on it (or skipped it: all rewards equal)
     and the new adapter serves, so every group is sampled from the newest policy;
  4. stops after `minutes` or once the goal has held for `patience` steps, stops the server, and
     writes a table, a reward-curve PNG (with the `plot` extra: matplotlib), the SQL to read the
     trajectories and `summary.json`.

A demo row is one group: sample it with the current policy, then one trainer step on it (the
trainer's `training_steps.step`; none when the group's rewards were all equal and it was skipped).
The reward of a row is the mean reward of its group, i.e. what the agent experienced. Every setting
the demo gives `serve` that differs from its default is printed and stored in summary.json.

The server's start, waits and stop are demo/harness.py's; the agents' plumbing demo/episodes.py's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from rlproxy.demo import directory, number_game, signals
from rlproxy.demo.canary import CANARY_ENV, canary_loop
from rlproxy.demo.episodes import default_model
from rlproxy.demo.harness import (
    Loop,
    PeakRSS,
    Plan,
    changed_settings,
    describe,
    engine_counters,
    engine_delta,
    fresh_out,
    mean,
    openai_client,
    print_line,
    serve_env,
    start_server,
    stop_server,
    wait_group,
)
from rlproxy.demo.pace import CpuShare, extend_to
from rlproxy.demo.plot import plot_rewards
from rlproxy.demo.rungs import evaluate, prompt_split
from rlproxy.demo.scorer import ScorerServer

log = logging.getLogger(__name__)

TASKS: dict[str, Any] = {"number": number_game, "directory": directory}  # name -> agent module


def run_demo(
    minutes: float = 10.0, model: str = "smollm2-135m", out_dir: str | Path = "demo-output",
    fast: bool = False, *, task: str = "number", backend: str = "embedded", group_size: int | None = None,
    learning_rate: float | None = None, seed: int = 0, goal: float = 0.5, patience: int = 3,
    max_groups: int | None = None, threads: int | None = None, temperature: float | None = None,
    max_tokens: int | None = None, echo: Callable[[str], None] | None = None, rollout: str = "immediate",
    eval_episodes: int | None = None, signal_mode: str | None = None, siblings: str | None = None,
    scorer: str | None = None, shadow: int | None = None, rung_minutes: float | None = None,
    max_steps: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the demo and return the summary (also written to `out_dir/summary.json`).

    The directory task is also measured in rungs (demo/rungs.py): `eval_episodes` fixed prompts
    (validation runs, never trained) before RL (`base`) and after it (`rl`), each reward component
    apart; default 16 (--fast: 4; 0: none). The RL groups draw their prompts at random, so a rung's
    prompt may also have been trained on.

    `task` names the agent (`TASKS`); its temperature and tokens per call are the task's unless
    given. `learning_rate` None keeps serve's default (chosen by model size). fast=True is the CI
    variant: the tiny random model, groups of 4, 3 groups.

    `signal_mode`, `siblings`, `scorer`, `shadow`, `rung_minutes`, `max_steps`: where the learning signal
    comes from, the rung curve that measures it and its step budget (demo/signals.py); all None is
    today's demo.
    """
    echo = echo or print_line
    if task not in TASKS:
        raise ValueError(f"unknown demo task {task!r}: choose one of {', '.join(TASKS)}")
    agent = TASKS[task]
    sig = signals.resolve(task, signal_mode, siblings, scorer, shadow, rung_minutes, max_steps)
    if not sig.legacy and rollout == "canary":
        raise ValueError("--rollout canary runs today's groups: leave out --signal, --siblings and --shadow")
    started = time.monotonic()
    if fast:
        # a canary needs runs on both arms before it decides (demo/canary.py): more groups
        model, group_size = "tiny", group_size or 4
        max_groups = max_groups or (40 if rollout == "canary" else 3)
    plan = Plan(
        task,
        minutes,
        model,
        backend,
        group_size or 8,
        learning_rate,
        seed,
        goal,
        patience,
        max_groups,
        agent.TEMPERATURE if temperature is None else temperature,
        agent.MAX_TOKENS if max_tokens is None else max_tokens,
    )
    out = fresh_out(out_dir)
    env = serve_env(out, threads, seed, learning_rate, backend == "embedded")
    if rollout == "canary":  # issue 28: new steps earn their traffic (demo/canary.py)
        env |= CANARY_ENV
    scorer_server = ScorerServer(task) if sig.scorer == "url" else None  # the task's checker, over HTTP
    if scorer_server is not None:
        scorer_server.start()
    score_url = scorer_server.score_url if scorer_server is not None else None
    extra = sig.serve_settings(score_url, plan.group_size)
    changed = changed_settings(env, out, backend, model, plan.group_size, extra)
    lr = "serve's default" if learning_rate is None else f"{learning_rate:g}"
    echo(
        f"rlproxy demo: task {task}, {plan.model} ({backend}), groups of {plan.group_size}, lr {lr}, "
        f"seed {seed}, {minutes:g} min"
    )
    if not sig.legacy:
        at = f", scorer at {score_url}" if score_url else ""
        echo(
            f"signal: {sig.signal or 'groups'} (siblings {sig.siblings}, scorer {sig.scorer or '-'}, "
            f"shadow {sig.shadow}); rungs every {sig.rung_minutes:g} min{at}"
        )
    echo(f"settings changed from the defaults: {describe(changed)}")
    echo(f"starting `rlproxy serve` (log: {out / 'serve.log'}) ...")
    try:
        proc, base = start_server(out, plan.model, 0, plan.group_size, env, backend=backend, extra=extra)
    except BaseException:
        if scorer_server is not None:
            scorer_server.stop()
        raise
    rss = PeakRSS(proc.pid)
    rss.start()
    cpu = CpuShare(proc.pid)  # demo/pace.py: the share of the machine it gets
    startup_s = time.monotonic() - started
    echo(f"serving at {base}/v1 after {startup_s:.1f}s; agent: {agent.__name__}")

    rows: list[dict[str, Any]] = []
    rungs: list[dict[str, Any]] = []
    n_eval = (4 if fast else 16) if eval_episodes is None else eval_episodes
    curve: signals.Curve | None = None
    try:
        agents = openai_client(base)
        loop = Loop(base, agents, default_model(agents), plan, agent, rows, started, echo, out / "rlproxy.db")
        if not sig.legacy:  # the rungs over time, on both tasks; the app posts no reward with the scorer
            curve = signals.Curve(task, loop, seed, n_eval or 4, sig.signal != "scorer")
            curve.measure("base")
            stop_reason = signals.signal_loop(loop, sig, curve)
            curve.measure("rl")
            rungs = curve.rungs
        else:  # directory: base and after RL on the same prompts, each component apart
            pairs = prompt_split(seed, 0, n_eval, 0)[1] if task == "directory" and n_eval else None
            if pairs:
                rungs.append(evaluate(agents, base, loop.policy, "base", pairs, seed, echo))
            stop_reason = canary_loop(loop) if rollout == "canary" else _loop(loop, cpu)
            if pairs:
                rungs.append(evaluate(agents, base, loop.policy, "rl", pairs, seed, echo))
    except KeyboardInterrupt:
        stop_reason = "interrupted"
        echo("interrupted: stopping the server and writing what there is")
        rungs = curve.rungs if curve is not None else rungs
    finally:
        cpu_seen = cpu.read()
        stop_server(proc)
        peak_rss_mb = rss.stop()
        if scorer_server is not None:
            scorer_server.stop()
    curve_rungs = None if sig.legacy else rungs
    summary = _report(
        out, plan, changed, rows, started, startup_s, peak_rss_mb, stop_reason, echo, curve_rungs
    )
    summary["cpu"] = cpu_seen
    if not sig.legacy:
        summary |= signals.report(sig, out / "rlproxy.db", rungs, scorer_server, echo)
    elif rungs:  # directory: base and after RL on the same prompts, each component apart
        summary["rungs"] = [{k: v for k, v in r.items() if k != "example"} for r in rungs]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _loop(loop: Loop, cpu: CpuShare | None = None) -> str:
    """One group per iteration, appended to `rows`; returns why it stopped (goal, time, max_groups).
    On a busy machine (`cpu`) a demo out of time without its goal extends once (demo/pace.py)."""
    plan, rows, echo = loop.plan, loop.rows, loop.echo
    with httpx.Client(base_url=loop.base, timeout=30) as http:
        deadline, minutes = loop.started + plan.minutes * 60, plan.minutes
        held, extended = 0, False
        while True:
            if (why := loop.stop(deadline, ceiling=extended)) is not None:
                seen = cpu.read() if cpu is not None and why == "time" else None
                longer = extend_to(minutes, seen) if seen else None
                if longer is None:
                    return why  # max_groups, or the next group would end after the deadline
                echo(
                    f"the demo got {seen['share']:.0%} of the CPU (others kept {seen['others_cores']:.1f} "
                    f"cores busy): going on up to {longer:g} min in all"
                )
                deadline, minutes, extended = loop.started + longer * 60, longer, True
                continue
            t0 = time.monotonic()
            counters = engine_counters(http)
            episodes = loop.group()
            sampled_s = time.monotonic() - t0
            engine = engine_delta(counters, engine_counters(http))
            runs, trained = wait_group(http, episodes[0].group_id, plan.group_size, loop.policy)
            row = {
                "group": len(rows) + 1,
                "step": max(trained) if trained else None,  # training_steps.step; None = skipped
                "mean_reward": mean([e.reward for e in episodes]),
                "runs": len(episodes),
                "calls": mean([float(len(e.replies)) for e in episodes]),  # model calls per episode
                "seconds": round(time.monotonic() - t0, 2),
                "sample_seconds": round(sampled_s, 2),
                "engine": engine,  # where the sampling went (embedded engine; {} for vLLM)
                "status": "trained" if trained else runs[0]["status"],
                "reason": None if trained else runs[0].get("status_reason"),  # zero_variance, ...
                "example": episodes[0].replies,
            }
            rows.append(row)
            first3 = mean([r["mean_reward"] for r in rows[:3]])
            last3 = mean([r["mean_reward"] for r in rows[-3:]])
            step = "-" if row["step"] is None else str(row["step"])
            echo(
                f"group {row['group']:3d}  step {step:>3}  reward {row['mean_reward']:.3f}  "
                f"last3 {last3:.3f}  "
                f"{row['status']:8s} {row['seconds']:5.1f}s  {time.monotonic() - loop.started:6.0f}s total  "
                f"e.g. {row['example']!r}"
            )
            held = held + 1 if len(rows) >= 6 and last3 - first3 >= plan.goal else 0
            if held >= plan.patience:
                return "goal"


def _report(
    out: Path,
    plan: Plan,
    changed: dict[str, dict[str, Any]],
    rows: list[dict[str, Any]],
    started: float,
    startup_s: float,
    peak_rss_mb: float,
    stop_reason: str,
    echo: Callable[[str], None],
    rungs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The table, the PNG (with `rungs`: their curve too), the SQL and summary.json."""
    rewards = [r["mean_reward"] for r in rows]
    first3, last3 = mean(rewards[:3]), mean(rewards[-3:])
    db = out / "rlproxy.db"
    plot = plot_rewards(rows, out / "reward_curve.png", plan.model, echo, task=plan.task, rungs=rungs)
    sql = (
        "SELECT t.reward, t.messages FROM trajectories t JOIN runs r ON r.id = t.run_id "
        "ORDER BY r.created_at DESC LIMIT 10;\n"
        "SELECT step, num_runs, mean_reward, loss, finished_at FROM training_steps ORDER BY step;\n"
        "SELECT group_id, count(*) AS runs, avg(reward) AS mean_reward FROM runs "
        "GROUP BY group_id ORDER BY min(created_at);\n"
        "SELECT status, count(*), avg(reward) FROM runs GROUP BY status;"
    )
    summary: dict[str, Any] = {
        "task": plan.task,
        "groups": len(rows),
        "trained_steps": sum(1 for r in rows if r["status"] == "trained"),
        "last_step": max((r["step"] for r in rows if r["step"] is not None), default=None),
        "first3_mean_reward": first3,
        "last3_mean_reward": last3,
        "improvement": round(last3 - first3, 4) if rows else None,
        "minutes": round((time.monotonic() - started) / 60, 2),
        "startup_seconds": round(startup_s, 1),
        "stop_reason": stop_reason,
        "peak_rss_mb": peak_rss_mb,
        "db": str(db),
        "plot": str(plot) if plot is not None else None,
        "model": plan.model,
        "plan": asdict(plan),
        "settings_changed": changed,  # every setting serve got that differs from its default
        "sql": sql,
        "rows": [{k: v for k, v in r.items() if k != "example"} for r in rows],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    echo("")
    echo(f"{'group':>5}  {'step':>4}  {'mean reward':>11}  {'runs':>4}  {'calls':>5}  {'seconds':>7}  status")
    for r in rows:
        step = "-" if r["step"] is None else r["step"]
        echo(
            f"{r['group']:>5}  {step:>4}  {r['mean_reward']:>11.3f}  {r['runs']:>4}  {r['calls']:>5.1f}  "
            f"{r['seconds']:>7.1f}  {r['status']}"
        )
    if rows:
        echo(
            f"\nfirst 3 groups {first3:.3f} -> last 3 groups {last3:.3f} ({last3 - first3:+.3f}) in "
            f"{summary['minutes']:.1f} min; {len(rows)} groups, {summary['trained_steps']} trainer steps; "
            f"peak RSS of the server {peak_rss_mb:.0f} MB"
        )
    echo(f"settings changed from the defaults: {describe(changed)}")
    if plot is not None:
        echo(f"reward curve: {plot}")
    echo(f"summary: {out / 'summary.json'}")
    queries = sql.splitlines()
    echo(f'the latest trajectories, in SQL:\n  sqlite3 {db} "{queries[0]}"')
    echo(f'  rlproxy sql --db {db} "{queries[1]}"')
    echo(
        f'  (more in summary.json\'s "sql"; dashboard: rlproxy dashboard --db {db}, then open http://127.0.0.1:8100/)'
    )
    return summary
