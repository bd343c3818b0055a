"""The demo's harness: the `rlproxy serve` it drives, started as a user starts it, watched (peak
memory), waited on (a group trained, a step published, the engine's counters) and stopped; the
settings it gets that differ from their defaults; and what the demo's loops share (`Loop`).

`cli(...)` is the one place the demo spells the command line (`serve`, and `sft` for the teacher
demo): the `rlproxy` script beside this Python, or `python -m rlproxy.cli` where none is installed
(a source checkout run without `pip install -e`).
"""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI
from pydantic import TypeAdapter, ValidationError

from rlproxy.demo.episodes import Episode
from rlproxy.settings import Settings

log = logging.getLogger(__name__)

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


@dataclass
class Loop:
    """What each of the demo's loops (run._loop, canary.canary_loop, signals.signal_loop) is given:
    the server and its client, the plan, the agent and its policy, the rows so far, the start time
    and where lines go."""

    base: str
    client: OpenAI
    policy: str
    plan: Plan
    agent: Any  # the task's module: demo/number_game.py or demo/directory.py
    rows: list[dict[str, Any]]
    started: float
    echo: Callable[[str], None]
    db: Path

    def stop(self, deadline: float, paced: bool = True, ceiling: bool = False) -> str | None:
        """ "max_groups", or "time" once the next group (`paced`: as long as the last three on average;
        at the `ceiling`, a limit that holds, as long as the longest of them: on a busy machine a group's
        time varies 4x, and the mean overran the 15-minute ceiling) would end after `deadline`."""
        if self.plan.max_groups is not None and len(self.rows) >= self.plan.max_groups:
            return "max_groups"
        recent = [r["seconds"] for r in self.rows[-3:]] if paced else []
        expect = max(recent, default=0.0) if ceiling else sum(recent) / len(recent) if recent else 0.0
        return "time" if time.monotonic() + expect > deadline else None

    def group(self) -> list[Episode]:
        """The next group of the agent's own task from the policy, each reward posted."""
        p = self.plan
        seed = p.seed * 100_000 + len(self.rows)
        return self.agent.run_group(self.client, self.policy, f"{self.base}/v1", "not-needed", p.group_size,
                                    p.temperature, p.max_tokens, seed=seed)  # fmt: skip


def openai_client(base: str) -> OpenAI:
    """The agents' OpenAI client for the demo's server (`base` without /v1)."""
    return OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=1, timeout=300)


def print_line(line: str) -> None:
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


def cli(*args: str) -> list[str]:
    """The command line of `rlproxy ARGS...` (see the module's docstring)."""
    exe = Path(sys.executable).with_name("rlproxy")
    return [str(exe), *args] if exe.is_file() else [sys.executable, "-m", "rlproxy.cli", *args]


def fresh_out(out_dir: str | Path) -> Path:
    """The output folder, without a previous demo's database, summary, curve and checkpoints (a fresh
    policy, not a resumed one)."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("rlproxy.db", "rlproxy.db-wal", "rlproxy.db-shm", "summary.json", "reward_curve.png"):
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return out


def serve_env(
    out: Path, threads: int | None, seed: int, learning_rate: float | None, embedded: bool
) -> dict[str, str]:
    """The variables every demo gives `serve`; `threads` None: the CPUs, up to 4."""
    threads = threads or max(1, min(os.cpu_count() or 1, 4))
    env = {
        "RLPROXY_CHECKPOINT_DIR": str(out / "checkpoints"),  # beside the demo's database
        "RLPROXY_POLL_INTERVAL": "0.2",  # the agent waits for each step: look for it often
        "RLPROXY_KEEP_CHECKPOINTS": "2",
        "RLPROXY_UNLOAD_GRACE": "5",
        "RLPROXY_TRAIN_THREADS": str(threads),
        "RLPROXY_SEED": str(seed),
    }
    if embedded:
        env["RLPROXY_ENGINE_THREADS"] = str(threads)
    if learning_rate is not None:
        env["RLPROXY_LEARNING_RATE"] = str(learning_rate)
    return env


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
        *cli("serve"),
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


def wait_group(
    http: httpx.Client, group_id: str, n: int, policy: str
) -> tuple[list[dict[str, Any]], list[int]]:
    """`wait_trained`, then `wait_policy_step` for the newest step trained on the group: (its runs,
    the steps that trained them)."""
    runs = wait_trained(http, group_id, n, timeout=600)
    steps = [r["trained_step"] for r in runs if r["status"] == "trained" and r["trained_step"]]
    if steps:
        wait_policy_step(http, policy, max(steps))
    return runs, steps


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


def mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def changed_settings(
    env: dict[str, str],
    out: Path,
    backend: str,
    model: str,
    group_size: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every setting `serve` will see that differs from its default: `{name: {value, default, source}}`.

    Sources: "demo" (an option or variable the demo sets) or "environment" (an RLPROXY_* variable of
    the caller, which `serve` inherits). Keys are shown as "***".
    """
    flags = {"backend": backend, "model": model, "db_url": f"sqlite+aiosqlite:///{out / 'rlproxy.db'}"}
    flags |= {"host": "127.0.0.1", "port": 0, "train": True, "group_size": group_size} | (extra or {})
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


def describe(changed: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{k}={v['value']} (default {v['default']})" for k, v in changed.items()) or "none"
