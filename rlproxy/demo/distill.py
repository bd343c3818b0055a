"""`rlproxy demo --task directory --teacher`: from a hosted model to your own, in three rungs.

The path teams take in practice (issue 25): capture a hosted model's conversations, distill the small
model on the good ones, then RL from there. Everything goes through one `rlproxy serve`:

  1. teacher: N directory episodes answered by the `teacher` policy, a hosted upstream
     (`RLPROXY_HOSTED_UPSTREAMS`). With no network here the teacher is a scripted expert
     (`directory.expert`) behind an OpenAI-compatible endpoint of its own (demo/provider.py,
     strict like OpenAI: a capture field would be a 400). It stands for a hosted model: pointing
     `RLPROXY_HOSTED_UPSTREAMS` at `teacher=https://api.openai.com/v1` is the only change. Its rows are
     stored text only (token ids NULL, source `hosted`); the trainer skips them and says so.
  2. rung `base`: the student's base model on fresh prompts (validation runs: never trained).
  3. distill: `rlproxy sft --policy BASE --from-policy teacher --into student` (another process, as a
     user runs it): the teacher's conversations in the student's chat template, assistant turns only.
     `serve` picks up `student@1` within its poll. Rung `sft`: the same fresh prompts.
  4. RL: groups of the same task on new prompts with model `student`: the trainer continues from the
     distilled adapter, one GRPO step per group. Rung `rl`: the same fresh prompts again. RL stops
     early when CEILING_GROUPS groups in a row scored the best reward on every episode: equal
     rewards carry no gradient (measured: after SFT on 32 teacher episodes SmolLM2-135M scores 1.0
     on fresh prompts, so every RL group is skipped as zero-variance).

Each rung stores its mean reward and each component separately: `well_formed_call` (episodes in which
the server parsed a lookup tool call from a reply), `correct_lookup` (the two people looked up), and
`correct_answer` (the two extensions in the final answer), in [0, 1]. The prompts (pairs of people)
are split once per seed into teacher, evaluation and RL prompts that never overlap.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from rlproxy.demo import directory, harness
from rlproxy.demo.episodes import default_model
from rlproxy.demo.provider import Provider, ProviderServer
from rlproxy.demo.rungs import COMPONENTS, components, evaluate, line, play, prompt_split, rung, table

TEACHER = "teacher"
STUDENT = "student"
TEACHER_EPISODES = 32  # the teacher's conversations the student learns from
EVAL_EPISODES = 16  # fresh prompts per rung (validation runs)
RL_GROUPS = 20  # trainer steps at most after the SFT step
CEILING_GROUPS = 3  # RL stops after this many groups in a row scored the best reward on every episode
SFT_EPOCHS = 4
SFT_BATCH = 8
SFT_LR = 1e-3  # LoRA r=8 on SmolLM2-135M: the trainer's measured rate for the model size


def run_distill_demo(
    minutes: float = 15.0,
    model: str = "smollm2-135m",
    out_dir: str | Path = "demo-output",
    fast: bool = False,
    *,
    seed: int = 0,
    group_size: int | None = None,
    learning_rate: float | None = None,
    teacher_episodes: int | None = None,
    eval_episodes: int | None = None,
    rl_groups: int | None = None,
    sft_epochs: int = SFT_EPOCHS,
    sft_lr: float = SFT_LR,
    threads: int | None = None,
    echo: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the three rungs and return the summary (also `out_dir/summary.json`). fast=True is the CI
    variant: the tiny random model and a handful of episodes (the plumbing, not the learning)."""
    echo = echo or harness.print_line
    started = time.monotonic()
    if fast:
        model = "tiny"
        group_size, teacher_episodes = group_size or 4, teacher_episodes or 8
        eval_episodes, rl_groups = eval_episodes or 4, rl_groups or 2
    group_size = group_size or 8
    n_teacher, n_eval = teacher_episodes or TEACHER_EPISODES, eval_episodes or EVAL_EPISODES
    n_rl = RL_GROUPS if rl_groups is None else rl_groups
    teach_pairs, eval_pairs, rl_pairs = prompt_split(seed, n_teacher, n_eval, n_rl)
    temperature, max_tokens = directory.TEMPERATURE, directory.MAX_TOKENS
    out = harness.fresh_out(out_dir)
    provider = Provider(directory.expert, api_key=f"sk-{secrets.token_hex(16)}", model="hosted-expert")
    teacher_server = ProviderServer(provider).start()
    env = harness.serve_env(out, threads, seed, learning_rate, embedded=True) | {
        "RLPROXY_POLICY_POLL_INTERVAL": "0.5",
        # the teacher: a hosted, text-only upstream (one setting away from a real provider)
        "RLPROXY_HOSTED_UPSTREAMS": f"{TEACHER}={teacher_server.url}",
        "RLPROXY_HOSTED_MODELS": f"{TEACHER}=hosted-expert",
        "RLPROXY_UPSTREAM_API_KEY": provider.api_key,
    }
    changed = harness.changed_settings(env, out, "embedded", model, group_size)
    echo(
        f"rlproxy demo --teacher: directory task, teacher = a scripted expert behind its own "
        f"OpenAI-compatible endpoint {teacher_server.url} (it stands for a hosted model), student = "
        f"{model}, seed {seed}; {n_teacher} teacher episodes, {n_eval} fresh prompts per rung, "
        f"up to {n_rl} RL groups of {group_size}"
    )
    echo(f"settings changed from the defaults: {harness.describe(changed)}")
    proc, base = harness.start_server(out, model, 0, group_size, env)
    rss = harness.PeakRSS(proc.pid)
    rss.start()
    client = harness.openai_client(base)
    rungs: list[dict[str, Any]] = []
    rl_rows: list[dict[str, Any]] = []
    timings: dict[str, float] = {"startup": round(time.monotonic() - started, 1)}
    stop_reason = "done"
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            base_policy = default_model(client)
            # 1. the teacher answers through the proxy (text only; the trainer skips these runs)
            t0 = time.monotonic()
            taught = play(client, f"{base}/v1", TEACHER, teach_pairs, temperature=temperature,
                          max_tokens=max_tokens, seed=seed)  # fmt: skip
            timings["teacher"] = round(time.monotonic() - t0, 1)
            teacher_rung = rung("teacher", taught, timings["teacher"])
            echo(line(teacher_rung))

            # 2. rung base: the student's base model on the fresh prompts
            rungs.append(evaluate(client, base, base_policy, "base", eval_pairs, seed, echo))

            # 3. distill, as a user would: `rlproxy sft --from-policy teacher --into student`
            t0 = time.monotonic()
            teacher_rows = ["--from-policy", TEACHER, "--min-reward", "0.9"]
            distill(out, model, base_policy, teacher_rows, sft_epochs, sft_lr, env, echo)
            harness.wait_policy_step(http, STUDENT, 1, timeout=120)
            timings["sft"] = round(time.monotonic() - t0, 1)
            rungs.append(evaluate(client, base, STUDENT, "sft", eval_pairs, seed, echo))

            # 4. RL from the distilled adapter on new prompts: one trainer step per group
            deadline = started + minutes * 60
            t0 = time.monotonic()
            for g, pair in enumerate(rl_pairs):
                recent = [r["seconds"] for r in rl_rows[-3:]]
                eval_cost = rungs[-1]["seconds"]
                if time.monotonic() + (sum(recent) / len(recent) if recent else 0) + eval_cost > deadline:
                    stop_reason = "time"
                    break
                rl_rows.append(_rl_group(client, http, base, g, pair, group_size, seed, echo))
                if at_ceiling(rl_rows):
                    stop_reason = "ceiling"
                    echo(
                        f"RL stops: the last {CEILING_GROUPS} groups scored {directory.MAX_REWARD:g} on "
                        "every episode. Equal rewards carry no gradient (each group is skipped as "
                        "zero-variance), so GRPO has nothing left to learn on this task."
                    )
                    break
            timings["rl"] = round(time.monotonic() - t0, 1)
            rungs.append(evaluate(client, base, STUDENT, "rl", eval_pairs, seed, echo))
    except KeyboardInterrupt:
        stop_reason = "interrupted"
    finally:
        harness.stop_server(proc)
        peak = rss.stop()
        teacher_server.stop()
    summary = {
        "task": "directory",
        "path": "distill",
        "model": model,
        "seed": seed,
        "teacher": "a scripted expert behind an OpenAI-compatible endpoint (stands for a hosted model)",
        "teacher_rung": teacher_rung if "teacher_rung" in locals() else None,
        "rungs": [{k: v for k, v in r.items() if k != "example"} for r in rungs],
        "rl_steps": sum(1 for r in rl_rows if r["step"] is not None),
        "rl_rows": rl_rows,
        "minutes": round((time.monotonic() - started) / 60, 2),
        "timings_seconds": timings,
        "stop_reason": stop_reason,
        "peak_rss_mb": peak,
        "prompts": {"teacher": len(teach_pairs), "evaluation": len(eval_pairs), "rl": len(rl_pairs)},
        "settings_changed": changed,
        "db": str(out / "rlproxy.db"),
        "sql": "SELECT policy, source, count(*), sum(token_ids IS NULL) FROM completions GROUP BY 1, 2;",
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    echo("")
    for row in table(rungs):
        echo(row)
    echo(
        f"\n{summary['rl_steps']} RL steps after the SFT step; {summary['minutes']:.1f} min; "
        f"summary: {out / 'summary.json'}"
    )
    return summary


def at_ceiling(rows: list[dict[str, Any]], n: int = CEILING_GROUPS) -> bool:
    """The last `n` RL groups each scored the task's best reward on every episode, so the trainer
    skipped them as zero-variance: RL has no gradient left to follow (a group of equal rewards)."""
    last = rows[-n:]
    return len(last) == n and all(
        r["status"] == "skipped" and (r["mean_reward"] or 0.0) >= directory.MAX_REWARD - 1e-9 for r in last
    )


def distill(
    out: Path,
    model: str,
    policy: str,
    select: list[str],
    epochs: int,
    lr: float,
    env: dict[str, str],
    echo: Callable[[str], None],
) -> list[str]:
    """`rlproxy sft --policy POLICY SELECT... --into student` in a process of its own, as a user runs
    it, on `out`'s store; its lines are echoed and returned. `select` picks the conversations:
    `--from-policy teacher --min-reward 0.9` here, `--from-source import` for imported traces
    (bench/sft_from_traces.py)."""
    args = ["sft", "--policy", policy, *select, "--into", STUDENT, "--epochs", str(epochs),
            "--batch-size", str(SFT_BATCH), "--learning-rate", str(lr), "--model", model,
            "--db", str(out / "rlproxy.db"), "--checkpoint-dir", str(out / "checkpoints")]  # fmt: skip
    echo("distilling: " + " ".join(args))
    child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        harness.cli(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env
    )
    assert proc.stdout is not None
    lines = []
    for out_line in proc.stdout:
        lines.append(out_line.rstrip())
        echo("  " + lines[-1])
    if proc.wait() != 0:
        raise RuntimeError(f"rlproxy sft exited with {proc.returncode}")
    return lines


def _rl_group(
    client: OpenAI,
    http: httpx.Client,
    base: str,
    g: int,
    pair: tuple[str, str],
    size: int,
    seed: int,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    t0 = time.monotonic()
    gid = f"dir-rl-{uuid.uuid4().hex[:10]}"
    episodes = play(client, f"{base}/v1", STUDENT, [pair] * size, group_id=gid,
                    temperature=directory.TEMPERATURE, max_tokens=directory.MAX_TOKENS,
                    seed=seed * 100_000 + g)  # fmt: skip
    runs, trained = harness.wait_group(http, gid, size, STUDENT)
    row = {
        "group": g + 1,
        "step": max(trained) if trained else None,
        "mean_reward": harness.mean([e.reward for e in episodes]),
        **{c: harness.mean([components(e)[c] for e in episodes]) for c in COMPONENTS},
        "seconds": round(time.monotonic() - t0, 1),
        "status": "trained" if trained else runs[0]["status"],
    }
    step = "-" if row["step"] is None else row["step"]
    echo(
        f"RL group {row['group']:3d}  step {step:>3}  reward {row['mean_reward']:.3f}  "
        f"{row['status']:8s} {row['seconds']:5.1f}s"
    )
    return row
