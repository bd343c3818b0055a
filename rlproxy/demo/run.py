"""`rlproxy demo`: the whole loop on a laptop CPU, from an unmodified agent to a better model.

What it does, in order:
  1. starts `rlproxy serve` as a subprocess (exactly what a user runs): the embedded engine with
     SmolLM2-135M-Instruct, SQLite in `out_dir`, the trainer on; its peak memory is sampled;
  2. runs the number-game agent (`demo/number_game.py`, a plain OpenAI-SDK program; also
     `examples/number_game/agent.py`) against it, one group of episodes at a time; the episodes of
     a group run concurrently;
  3. after each group waits until the trainer has trained on it (or skipped it: all rewards equal)
     and the new adapter serves, so every group is sampled from the newest policy;
  4. stops after `minutes` or once the goal has held for `patience` steps, stops the server, and
     writes a table, a reward-curve PNG (with the `plot` extra: matplotlib), the SQL to read the
     trajectories and `summary.json`.

A demo step is one group: sample it with the current policy, then one trainer step on it. The
reward of a step is the mean reward of its group, i.e. what the agent experienced.
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

from rlproxy.demo import number_game
from rlproxy.demo.plot import plot_rewards

log = logging.getLogger(__name__)

FINAL_STATUSES = frozenset({"trained", "skipped", "failed", "expired"})
_READY = re.compile(r"OPENAI_BASE_URL=(http://[\w.:\[\]-]+)/v1")


@dataclass
class Plan:
    """The demo's resolved parameters (saved in summary.json)."""

    minutes: float
    model: str
    group_size: int
    learning_rate: float
    goal: float  # last-3 minus first-3 mean reward that counts as learned
    patience: int  # steps the goal must hold before stopping early
    max_steps: int | None
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
    return [sys.executable, "-c", "from rlproxy.proxy.cli import app; app()", "serve"]


def start_server(
    out: Path, model: str, port: int, group_size: int, env_overrides: dict[str, str], timeout: float = 900.0
) -> tuple[subprocess.Popen, str]:
    """Start `rlproxy serve` and wait for its /healthz; returns (process, base URL without /v1).

    port 0 lets the server pick a free port (no race with other processes); the URL is then read
    from the line `serve` prints when it listens.
    """
    db = out / "rlproxy.db"
    cmd = [
        *_serve_command(),
        f"--model={model}",
        f"--db={db}",
        "--host=127.0.0.1",
        f"--port={port}",
        "--train",
        f"--group-size={group_size}",
        "--groups-per-step=1",
        "--no-access-log",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RLPROXY_API_KEY"}  # the demo runs without a key
    env.update(env_overrides)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"  # the ready line must reach the log at once
    log_file = open(out / "serve.log", "wb")  # the child keeps its own handle
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def run_demo(
    minutes: float = 10.0,
    model: str = "smollm2-135m",
    out_dir: str | Path = "demo-output",
    fast: bool = False,
    *,
    group_size: int | None = None,
    learning_rate: float = 1e-3,
    goal: float = 0.5,
    patience: int = 3,
    max_steps: int | None = None,
    threads: int | None = None,
    temperature: float = 1.0,
    max_tokens: int = 8,
    echo: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the demo and return the summary (also written to `out_dir/summary.json`).

    fast=True is the CI variant: the tiny random model, groups of 4, 3 steps.
    """
    echo = echo or _echo
    started = time.monotonic()
    if fast:
        model, group_size, max_steps = "tiny", group_size or 4, max_steps or 3
    plan = Plan(
        minutes, model, group_size or 8, learning_rate, goal, patience, max_steps, temperature, max_tokens
    )
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("rlproxy.db", "rlproxy.db-wal", "rlproxy.db-shm", "summary.json", "reward_curve.png"):
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a fresh policy, not a resumed one

    threads = threads or max(1, min(os.cpu_count() or 1, 4))
    env = {
        "RLPROXY_LEARNING_RATE": str(learning_rate),
        "RLPROXY_CHECKPOINT_DIR": str(out / "checkpoints"),
        "RLPROXY_POLL_INTERVAL": "0.2",
        "RLPROXY_KEEP_CHECKPOINTS": "2",
        "RLPROXY_UNLOAD_GRACE": "5",
        "RLPROXY_ENGINE_THREADS": str(threads),
        "RLPROXY_TRAIN_THREADS": str(threads),
        "RLPROXY_SEED": "0",
    }
    echo(f"rlproxy demo: {plan.model}, groups of {plan.group_size}, lr {learning_rate:g}, {minutes:g} min")
    echo(f"starting `rlproxy serve` (log: {out / 'serve.log'}) ...")
    proc, base = start_server(out, plan.model, 0, plan.group_size, env)
    rss = PeakRSS(proc.pid)
    rss.start()
    startup_s = time.monotonic() - started
    echo(f"serving at {base}/v1 after {startup_s:.1f}s; agent: {number_game.__name__}")

    rows: list[dict[str, Any]] = []
    try:
        stop_reason = _loop(base, plan, rows, started, echo)
    except KeyboardInterrupt:
        stop_reason = "interrupted"
        echo("interrupted: stopping the server and writing what there is")
    finally:
        stop_server(proc)
        peak_rss_mb = rss.stop()
    return _report(out, plan, rows, started, startup_s, peak_rss_mb, stop_reason, echo)


def _loop(
    base: str,
    plan: Plan,
    rows: list[dict[str, Any]],
    started: float,
    echo: Callable[[str], None],
) -> str:
    """One demo step per iteration, appended to `rows`; returns why it stopped (goal, time, max_steps)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=1, timeout=300)
    with httpx.Client(base_url=base, timeout=30) as http:
        policy = number_game.default_model(client)
        deadline = started + plan.minutes * 60
        held = 0
        while True:
            if plan.max_steps is not None and len(rows) >= plan.max_steps:
                return "max_steps"
            recent = [r["seconds"] for r in rows[-3:]]
            if time.monotonic() + (sum(recent) / len(recent) if recent else 0.0) > deadline:
                return "time"  # the next step would end after the deadline
            t0 = time.monotonic()
            episodes = number_game.run_group(
                client, policy, f"{base}/v1", "not-needed", plan.group_size, plan.temperature, plan.max_tokens
            )
            sampled_s = time.monotonic() - t0
            runs = wait_trained(http, episodes[0].group_id, plan.group_size, timeout=600)
            trained = [r["trained_step"] for r in runs if r["status"] == "trained" and r["trained_step"]]
            if trained:
                wait_policy_step(http, policy, max(trained))
            row = {
                "step": len(rows) + 1,
                "mean_reward": _mean([e.reward for e in episodes]),
                "runs": len(episodes),
                "seconds": round(time.monotonic() - t0, 2),
                "sample_seconds": round(sampled_s, 2),
                "trained_step": max(trained) if trained else None,
                "status": "trained" if trained else runs[0]["status"],
                "example": episodes[0].replies,
            }
            rows.append(row)
            first3 = _mean([r["mean_reward"] for r in rows[:3]])
            last3 = _mean([r["mean_reward"] for r in rows[-3:]])
            echo(
                f"step {row['step']:3d}  reward {row['mean_reward']:.3f}  last3 {last3:.3f}  "
                f"{row['status']:8s} {row['seconds']:5.1f}s  {time.monotonic() - started:6.0f}s total  "
                f"e.g. {row['example']!r}"
            )
            held = held + 1 if len(rows) >= 6 and last3 - first3 >= plan.goal else 0
            if held >= plan.patience:
                return "goal"


def _report(
    out: Path,
    plan: Plan,
    rows: list[dict[str, Any]],
    started: float,
    startup_s: float,
    peak_rss_mb: float,
    stop_reason: str,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    """The table, the PNG, the SQL and summary.json."""
    rewards = [r["mean_reward"] for r in rows]
    first3, last3 = _mean(rewards[:3]), _mean(rewards[-3:])
    db = out / "rlproxy.db"
    plot = plot_rewards(rows, out / "reward_curve.png", plan.model, echo)
    sql = (
        "SELECT t.reward, t.messages FROM trajectories t JOIN runs r ON r.id = t.run_id "
        "ORDER BY r.created_at DESC LIMIT 10;\n"
        "SELECT step, num_runs, mean_reward, loss, finished_at FROM training_steps ORDER BY step;\n"
        "SELECT group_id, count(*) AS runs, avg(reward) AS mean_reward FROM runs "
        "GROUP BY group_id ORDER BY min(created_at);\n"
        "SELECT status, count(*), avg(reward) FROM runs GROUP BY status;"
    )
    summary: dict[str, Any] = {
        "steps": len(rows),
        "trained_steps": sum(1 for r in rows if r["status"] == "trained"),
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
        "sql": sql,
        "rows": [{k: v for k, v in r.items() if k != "example"} for r in rows],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    echo("")
    echo(f"{'step':>4}  {'mean reward':>11}  {'runs':>4}  {'seconds':>7}  status")
    for r in rows:
        echo(
            f"{r['step']:>4}  {r['mean_reward']:>11.3f}  {r['runs']:>4}  {r['seconds']:>7.1f}  {r['status']}"
        )
    if rows:
        echo(
            f"\nfirst 3 steps {first3:.3f} -> last 3 steps {last3:.3f} ({last3 - first3:+.3f}) in "
            f"{summary['minutes']:.1f} min; {len(rows)} steps ({summary['trained_steps']} trained); "
            f"peak RSS of the server {peak_rss_mb:.0f} MB"
        )
    if plot is not None:
        echo(f"reward curve: {plot}")
    echo(f"summary: {out / 'summary.json'}")
    queries = sql.splitlines()
    echo(f'the latest trajectories, in SQL:\n  sqlite3 {db} "{queries[0]}"')
    echo(f'  rlproxy sql --db {db} "{queries[1]}"')
    echo(
        f'  (more in summary.json\'s "sql"; dashboard: rlproxy serve --no-train --db {db}, then open http://127.0.0.1:8000/)'
    )
    return summary
