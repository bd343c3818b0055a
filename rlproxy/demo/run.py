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

(Over 400 lines: the demo is one script read top to bottom (start, drive, wait, measure, stop) whose
steps share the server process and the output folder; the agents and the rungs are in their own
files.)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import TypeAdapter, ValidationError

from rlproxy.demo import directory, number_game, signals
from rlproxy.demo.canary import CANARY_ENV, canary_loop
from rlproxy.demo.pace import CpuShare, extend_to
from rlproxy.demo.plot import plot_rewards
from rlproxy.demo.rungs import evaluate, prompt_split
from rlproxy.demo.scorer import ScorerServer
from rlproxy.settings import Settings

log = logging.getLogger(__name__)

TASKS: dict[str, Any] = {"number": number_game, "directory": directory}  # name -> agent module
FINAL_STATUSES = frozenset({"trained", "skipped", "failed", "expired"})
_READY = re.compile(r"OPENAI_BASE_URL=(http://[\w.:\[\]-]+)/v1")


@dataclass
class Plan:
    """The demo's resolved parameters (saved in summary.json)."""

    task: str
    minutes: float
    model: str
    backend: str
    group_size: int
    learning_rate: float | None  # None = serve's default (chosen by model size)
    seed: int  # the trainer's seed and the agent's sampling seeds
    goal: float  # last-3 minus first-3 mean reward that counts as learned
    patience: int  # steps the goal must hold before stopping early
    max_groups: int | None  # stop after this many groups
    temperature: float
    max_tokens: int


def _echo(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class PeakRSS(threading.Thread):
    """Samples the resident memory of a process and its children; `peak_mb` is the largest sum seen."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        super().__init__(daemon=True, name="demo-rss")
        self.pid, self.interval, self.peak_mb = pid, interval, 0.0
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            proc = psutil.Process(self.pid)
            while not self._stop_event.is_set():
                procs = [proc, *proc.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak_mb = max(self.peak_mb, total / 2**20)
                self._stop_event.wait(self.interval)
        except psutil.Error:  # the process is gone
            return

    def stop(self) -> float:
        self._stop_event.set()
        self.join(timeout=5)
        return round(self.peak_mb, 1)


def _serve_command() -> list[str]:
    exe = Path(sys.executable).with_name("rlproxy")
    if exe.is_file():
        return [str(exe), "serve"]
    return [sys.executable, "-c", "from rlproxy.cli.main import app; app()", "serve"]


def start_server(
    out: Path,
    model: str,
    port: int,
    group_size: int,
    env_overrides: dict[str, str],
    timeout: float = 900.0,
    backend: str = "embedded",
    extra: dict[str, Any] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start `rlproxy serve` and wait for its /healthz; returns (process, base URL without /v1).

    port 0 lets the server pick a free port (no race with other processes); the URL is then read
    from the line `serve` prints when it listens. `extra` are more settings, given as options
    (`{"siblings": "new"}` is `--siblings=new`); groups_per_step is 1 unless it says otherwise.
    """
    db = out / "rlproxy.db"
    cmd = [
        *_serve_command(),
        f"--backend={backend}",
        f"--model={model}",
        f"--db={db}",
        "--host=127.0.0.1",
        f"--port={port}",
        "--train",
        f"--group-size={group_size}",
        *(f"--{k.replace('_', '-')}={v}" for k, v in ({"groups_per_step": 1} | (extra or {})).items()),
        "--no-access-log",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RLPROXY_API_KEY"}  # the demo runs without a key
    env.update(env_overrides)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"  # the ready line must reach the log at once
    log_file = open(out / "serve.log", "wb")  # the child keeps its own handle
    proc = subprocess.Popen(
        cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        preexec_fn=_die_with_us,
    )  # fmt: skip
    log_file.close()
    base = f"http://127.0.0.1:{port}" if port else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (out / "serve.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"rlproxy serve exited with {proc.returncode}:\n{tail}")
        if not base:  # port 0: serve prints the URL it got once it listens
            found = _READY.search((out / "serve.log").read_text(errors="replace"))
            base = found.group(1) if found else ""
        try:
            if base and httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(proc)
    raise TimeoutError(f"rlproxy serve was not healthy after {timeout:.0f}s (see {out / 'serve.log'})")


def _die_with_us() -> None:
    """In the child: SIGTERM when the demo's process is gone, however it went (Linux's
    PR_SET_PDEATHSIG; elsewhere the demo's own SIGTERM/SIGINT handling is all there is)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGINT (a graceful shutdown: the writer drains), then SIGKILL if it hangs."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("rlproxy serve did not stop in %.0fs; killing it", timeout)
        proc.kill()
        proc.wait(timeout=10)


def wait_trained(http: httpx.Client, group_id: str, n: int, timeout: float) -> list[dict[str, Any]]:
    """Wait until the trainer has dealt with the group's `n` runs (trained or skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        runs = http.get("/v1/runs", params={"group_id": group_id, "limit": n}).json()["data"]
        if len(runs) >= n and all(r["status"] in FINAL_STATUSES for r in runs):
            return runs
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"group {group_id} not trained after {timeout:.0f}s: {[r['status'] for r in runs]}"
            )
        time.sleep(0.2)


def wait_policy_step(http: httpx.Client, policy: str, step: int, timeout: float = 60.0) -> None:
    """Wait until the proxy routes `policy` to `step` (published right after the step commits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http.get("/healthz").json().get("policies", {}).get(policy, 0) >= step:
            return
        time.sleep(0.1)
    log.warning("policy %s did not reach step %d in %.0fs", policy, step, timeout)


def engine_counters(http: httpx.Client) -> dict[str, float]:
    """The embedded engine's counters from /metrics (`rlproxy_engine_*`, names without the prefix)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("rlproxy_engine_") and not sample.name.endswith("_created"):
                out[sample.name.removeprefix("rlproxy_engine_").removesuffix("_total")] = sample.value
    return out


def engine_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Where a group's sampling went in the engine: worker seconds prefilling and decoding, decode
    steps and their mean batch, prompt positions admitted vs run through the model."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if not d:
        return {}
    steps = d.get("decode_steps", 0.0)
    return {
        "prefill_s": round(d.get("prefill_seconds", 0.0), 2),
        "decode_s": round(d.get("decode_seconds", 0.0), 2),
        "decode_steps": int(steps),
        "mean_rows": round(d.get("decode_rows", 0.0) / steps, 2) if steps else 0.0,
        "tokens": int(d.get("tokens", 0.0)),
        "prompt_tokens": int(d.get("prompt_tokens", 0.0)),
        "prefill_tokens": int(d.get("prefill_tokens", 0.0)),
    }


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def changed_settings(flags: dict[str, Any], env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every setting `serve` will see that differs from its default: `{name: {value, default, source}}`.

    Sources: "demo" (an option or variable the demo sets) or "environment" (an RLPROXY_* variable of
    the caller, which `serve` inherits). Keys are shown as "***".
    """
    given: dict[str, tuple[Any, str]] = {}
    for key, value in os.environ.items():
        if key.startswith("RLPROXY_") and key != "RLPROXY_API_KEY":  # the demo runs without a key
            given[key.removeprefix("RLPROXY_").lower()] = (value, "environment")
    for key, value in env.items():
        given[key.removeprefix("RLPROXY_").lower()] = (value, "demo")
    for key, value in flags.items():
        given[key] = (value, "demo")
    changed: dict[str, dict[str, Any]] = {}
    for name, (value, source) in sorted(given.items()):
        field = Settings.model_fields.get(name)
        if field is None:
            continue
        default = field.default if field.default_factory is None else field.default_factory()
        try:
            value = TypeAdapter(field.annotation).validate_python(value)
        except ValidationError:
            pass  # shown as given; serve will say what is wrong with it
        if value != default:
            secret = name.endswith("_key")
            changed[name] = {
                "value": "***" if secret else value,
                "default": "***" if secret and default else default,
                "source": source,
            }
    return changed


def _describe(changed: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{k}={v['value']} (default {v['default']})" for k, v in changed.items()) or "none"


def run_demo(
    minutes: float = 10.0,
    model: str = "smollm2-135m",
    out_dir: str | Path = "demo-output",
    fast: bool = False,
    *,
    task: str = "number",
    backend: str = "embedded",
    group_size: int | None = None,
    learning_rate: float | None = None,
    seed: int = 0,
    goal: float = 0.5,
    patience: int = 3,
    max_groups: int | None = None,
    threads: int | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
    echo: Callable[[str], None] | None = None,
    rollout: str = "immediate",
    eval_episodes: int | None = None,
    signal_mode: str | None = None,
    siblings: str | None = None,
    scorer: str | None = None,
    shadow: int | None = None,
    rung_minutes: float | None = None,
) -> dict[str, Any]:
    """Run the demo and return the summary (also written to `out_dir/summary.json`).

    The directory task is also measured in rungs (demo/rungs.py): `eval_episodes` fixed prompts
    (validation runs, never trained) before RL (`base`) and after it (`rl`), each reward component
    apart; default 16 (--fast: 4; 0: none). The RL groups draw their prompts at random, so a rung's
    prompt may also have been trained on.

    `task` names the agent (`TASKS`); its temperature and tokens per call are the task's unless
    given. `learning_rate` None keeps serve's default (chosen by model size). fast=True is the CI
    variant: the tiny random model, groups of 4, 3 groups.

    `signal_mode`, `siblings`, `scorer`, `shadow`, `rung_minutes`: where the learning signal comes from
    and the rung curve that measures it (demo/signals.py); all None is today's demo.
    """
    echo = echo or _echo
    if task not in TASKS:
        raise ValueError(f"unknown demo task {task!r}: choose one of {', '.join(TASKS)}")
    agent = TASKS[task]
    sig = signals.resolve(task, signal_mode, siblings, scorer, shadow, rung_minutes)
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
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("rlproxy.db", "rlproxy.db-wal", "rlproxy.db-shm", "summary.json", "reward_curve.png"):
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a fresh policy, not a resumed one

    threads = threads or max(1, min(os.cpu_count() or 1, 4))
    env = {
        "RLPROXY_CHECKPOINT_DIR": str(out / "checkpoints"),  # beside the demo's database
        "RLPROXY_POLL_INTERVAL": "0.2",  # the agent waits for each step: look for it often
        "RLPROXY_KEEP_CHECKPOINTS": "2",
        "RLPROXY_UNLOAD_GRACE": "5",
        "RLPROXY_TRAIN_THREADS": str(threads),
        "RLPROXY_SEED": str(seed),
    }
    if backend == "embedded":
        env["RLPROXY_ENGINE_THREADS"] = str(threads)
    if learning_rate is not None:
        env["RLPROXY_LEARNING_RATE"] = str(learning_rate)
    if rollout == "canary":  # issue 28: new steps earn their traffic (demo/canary.py)
        env |= CANARY_ENV
    scorer_server = ScorerServer(task) if sig.scorer == "url" else None  # the task's checker, over HTTP
    if scorer_server is not None:
        scorer_server.start()
    score_url = scorer_server.score_url if scorer_server is not None else None
    extra = sig.serve_settings(score_url, plan.group_size)
    flags = {"backend": backend, "model": model, "db_url": f"sqlite+aiosqlite:///{out / 'rlproxy.db'}"}
    flags |= {"host": "127.0.0.1", "port": 0, "train": True, "group_size": plan.group_size} | extra
    changed = changed_settings(flags, env)
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
    echo(f"settings changed from the defaults: {_describe(changed)}")
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
        if not sig.legacy:  # the rungs over time, on both tasks; the app posts no reward with the scorer
            from openai import OpenAI

            client = OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=1, timeout=300)
            curve = signals.Curve(task, base, client, agent.default_model(client), seed, n_eval or 4,
                                  sig.signal != "scorer", started, echo)  # fmt: skip
            curve.measure("base")
            stop_reason = signals.signal_loop(
                base, plan, sig, agent, rows, started, echo, out / "rlproxy.db", curve
            )
            curve.measure("rl")
            rungs = curve.rungs
        else:
            measure = _rungs(base, seed, n_eval, rungs, echo) if task == "directory" and n_eval else None
            if measure:
                measure("base")
            if rollout == "canary":
                stop_reason = canary_loop(base, plan, agent, rows, started, echo, out / "rlproxy.db")
            else:
                stop_reason = _loop(base, plan, agent, rows, started, echo, cpu)
            if measure:
                measure("rl")
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


def _rungs(
    base: str, seed: int, n: int, rungs: list[dict[str, Any]], echo: Callable[[str], None]
) -> Callable[[str], None]:
    """`measure(name)`: one rung of the directory task's default policy on `n` fixed prompts."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=1, timeout=300)
    policy = directory.default_model(client)
    _, pairs, _ = prompt_split(seed, 0, n, 0)

    def measure(name: str) -> None:
        rungs.append(evaluate(client, base, policy, name, pairs, seed, echo))

    return measure


def _loop(
    base: str,
    plan: Plan,
    agent: Any,
    rows: list[dict[str, Any]],
    started: float,
    echo: Callable[[str], None],
    cpu: CpuShare | None = None,
) -> str:
    """One group per iteration, appended to `rows`; returns why it stopped (goal, time, max_groups).
    On a busy machine (`cpu`) a demo out of time without its goal extends once (demo/pace.py)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=1, timeout=300)
    with httpx.Client(base_url=base, timeout=30) as http:
        policy = agent.default_model(client)
        deadline, minutes = started + plan.minutes * 60, plan.minutes
        held = 0
        while True:
            if plan.max_groups is not None and len(rows) >= plan.max_groups:
                return "max_groups"
            recent = [r["seconds"] for r in rows[-3:]]
            if time.monotonic() + (sum(recent) / len(recent) if recent else 0.0) > deadline:
                seen = cpu.read() if cpu is not None else None
                longer = extend_to(minutes, seen) if seen else None
                if longer is None:
                    return "time"  # the next group would end after the deadline
                echo(
                    f"the demo got {seen['share']:.0%} of the CPU (others kept {seen['others_cores']:.1f} "
                    f"cores busy): going on up to {longer:g} min in all"
                )
                deadline, minutes = started + longer * 60, longer
                continue
            t0 = time.monotonic()
            counters = engine_counters(http)
            episodes = agent.run_group(
                client,
                policy,
                f"{base}/v1",
                "not-needed",
                plan.group_size,
                plan.temperature,
                plan.max_tokens,
                seed=plan.seed * 100_000 + len(rows),
            )
            sampled_s = time.monotonic() - t0
            engine = engine_delta(counters, engine_counters(http))
            runs = wait_trained(http, episodes[0].group_id, plan.group_size, timeout=600)
            trained = [r["trained_step"] for r in runs if r["status"] == "trained" and r["trained_step"]]
            if trained:
                wait_policy_step(http, policy, max(trained))
            row = {
                "group": len(rows) + 1,
                "step": max(trained) if trained else None,  # training_steps.step; None = skipped
                "mean_reward": _mean([e.reward for e in episodes]),
                "runs": len(episodes),
                "calls": _mean([float(len(e.replies)) for e in episodes]),  # model calls per episode
                "seconds": round(time.monotonic() - t0, 2),
                "sample_seconds": round(sampled_s, 2),
                "engine": engine,  # where the sampling went (embedded engine; {} for vLLM)
                "status": "trained" if trained else runs[0]["status"],
                "reason": None if trained else runs[0].get("status_reason"),  # zero_variance, ...
                "example": episodes[0].replies,
            }
            rows.append(row)
            first3 = _mean([r["mean_reward"] for r in rows[:3]])
            last3 = _mean([r["mean_reward"] for r in rows[-3:]])
            step = "-" if row["step"] is None else str(row["step"])
            echo(
                f"group {row['group']:3d}  step {step:>3}  reward {row['mean_reward']:.3f}  "
                f"last3 {last3:.3f}  "
                f"{row['status']:8s} {row['seconds']:5.1f}s  {time.monotonic() - started:6.0f}s total  "
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
    first3, last3 = _mean(rewards[:3]), _mean(rewards[-3:])
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
    echo(f"settings changed from the defaults: {_describe(changed)}")
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
