"""An SFT run from imported traces raises a task's rung (issue 58's acceptance): base vs after.

    .venv/bin/python bench/sft_from_traces.py                         # smollm2-135m, 32 traced episodes
    .venv/bin/python bench/sft_from_traces.py --format openai-jsonl   # the same, as OpenAI chat JSONL
    .venv/bin/python bench/sft_from_traces.py --fast                  # tiny random model: the plumbing
    .venv/bin/python bench/sft_from_traces.py --learn siblings        # RL on the imported prompts instead

The path as a team lives it, with rlproxy nowhere in the traced path:

1. The team's agent, the directory task's (rlproxy/demo/directory.py: two lookups, then an answer),
   plays `--episodes` episodes with a real `openai` client straight against a hosted model: the
   scripted expert behind an OpenAI-compatible endpoint of its own (demo/provider.py, the stand-in
   `rlproxy demo --teacher` uses). OpenInference (`openinference-instrumentation-openai`, what
   Phoenix's users run) instruments the client; the OTel SDK's BatchSpanProcessor hands the spans,
   one trace per episode, to a file exporter that writes them as the collector's file exporter does
   (OTLP/JSON, one ExportTraceServiceRequest a line; `--format otlp-proto`: length-delimited
   protobuf). OpenInference, not the official `opentelemetry-instrumentation-openai-v2`: 2.4b0 records
   no tool definitions, and the student has to learn its calls with the tools in its prompt.
   `--format openai-jsonl`: no tracer, each episode's conversation as OpenAI chat JSONL (the
   fine-tuning format), as the provider answered its last call.
2. `rlproxy import FILE --db STORE` (the CLI, a process of its own) into a fresh store.
3. `rlproxy serve` on that store with the student's base model: rung `base` on fresh prompts (the
   teacher demo's prompt split: never traced; validation runs), then `rlproxy sft --from-source
   import --into student` (a process of its own, `rlproxy demo --teacher`'s SFT settings), serve
   picks up student@1, rung `after` on the same prompts.

`--learn siblings` learns from the same traces' PROMPTS instead of their answers (issue 58's "a
prompt set the engine samples on"): the import names the policy (`--policy agent`), `serve` runs with
`siblings=agent=imported` and the url scorer (the task's own checker, demo/scorer.py, as `rlproxy demo
--signal scorer` uses), so the student answers each imported prompt K times, the checker scores the K
side by side and the trainer trains the groups; rung `after` once `--rl-minutes` have passed (the
base rung is the base model's own name, never trained: the same weights as agent@0). No app traffic
flows, so the siblings' engine share is raised to 0.9 (`siblings_max_share`; the app-first rule holds).

Prints base vs after with each component, the SFT's examples and seconds, `uptime` before and after,
and writes OUT_DIR/summary.json. Run it alone on a quiet box.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI
from openinference.instrumentation.openai import OpenAIInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlproxy.demo import directory, harness  # noqa: E402
from rlproxy.demo.distill import EVAL_EPISODES, SFT_EPOCHS, SFT_LR, STUDENT, TEACHER_EPISODES, distill  # noqa: E402
from rlproxy.demo.episodes import Episode, default_model, play_all  # noqa: E402
from rlproxy.demo.provider import Provider, ProviderServer  # noqa: E402
from rlproxy.demo.rungs import evaluate, prompt_split, rung, table  # noqa: E402
from rlproxy.demo.scorer import ScorerServer  # noqa: E402
from rlproxy.demo.store import siblings_summary  # noqa: E402

FORMATS = ("otlp", "otlp-proto", "openai-jsonl")
HOSTED = "hosted-expert"
LEARNER = "agent"  # --learn siblings: the policy the imported prompts are stored under and that learns


class OtlpFile(SpanExporter):
    """The OTel SDK's span exporter interface, writing each batch as one OTLP
    ExportTraceServiceRequest, made by `opentelemetry-exporter-otlp-proto-common`'s encoder: a JSON
    line (protobuf's JSON mapping) or, `proto`, a varint length and the message."""

    def __init__(self, path: Path, proto: bool) -> None:
        self.file = path.open("wb")
        self.proto = proto

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from google.protobuf import json_format
        from google.protobuf.internal.encoder import _VarintBytes
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        request = encode_spans(spans)
        if self.proto:
            self.file.write(_VarintBytes(request.ByteSize()) + request.SerializeToString())
        else:
            self.file.write(json.dumps(json_format.MessageToDict(request)).encode() + b"\n")
        self.file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.file.close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def trace_episodes(
    pairs: list[tuple[str, str]], path: Path, fmt: str, seed: int
) -> tuple[list[Episode], int]:
    """The team's agent: one directory episode per pair with a real `openai` client against the
    stand-in hosted model, written to `path` in `fmt` by what a team runs. (episodes, requests the
    provider answered)."""
    conversations: list[dict[str, Any]] = []

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        message = directory.expert(body)
        if not message.get("tool_calls"):  # an episode's last call: its whole conversation
            conversations.append({"model": body["model"], "messages": [*body["messages"], message],
                                  "tools": body.get("tools")})  # fmt: skip
        return message

    provider = Provider(answer, api_key=f"sk-{secrets.token_hex(16)}", model=HOSTED)
    server = ProviderServer(provider).start()
    client = OpenAI(base_url=server.url, api_key=provider.api_key, max_retries=1, timeout=60)
    tracing, instrumentor = TracerProvider(), OpenAIInstrumentor()
    if fmt != "openai-jsonl":
        tracing.add_span_processor(BatchSpanProcessor(OtlpFile(path, proto=fmt == "otlp-proto")))
        instrumentor.instrument(tracer_provider=tracing)
    tracer = tracing.get_tracer("team-agent")

    def one(i: int) -> Episode:
        with tracer.start_as_current_span("directory episode"):  # one trace per episode
            return directory.play_episode(client, HOSTED, None, pairs[i], seed=seed * 1000 + i)

    try:
        episodes = play_all(len(pairs), one, server.url, post=False, workers=8)
    finally:
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        tracing.shutdown()  # the batch processor's last export
        server.stop()
    if fmt == "openai-jsonl":
        path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return episodes, len(provider.requests)


def import_traces(path: Path, db: Path, fmt: str, *args: str) -> dict[str, Any]:
    """`rlproxy import` of the file, as a user runs it: its summary line, and its counts."""
    t0 = time.monotonic()
    done = subprocess.run(harness.cli("import", str(path), "--format", fmt, "--db", str(db), *args),
                          capture_output=True, text=True, check=True)  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1]
    counts = re.match(r"imported (\d+) call\(s\) in (\d+) new run\(s\)", summary)
    if counts is None:
        raise RuntimeError(f"rlproxy import said: {done.stdout}{done.stderr}")
    return {"calls": int(counts[1]), "runs": int(counts[2]), "line": summary,
            "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


def run(
    model: str = "smollm2-135m",
    episodes: int = TEACHER_EPISODES,
    eval_episodes: int = EVAL_EPISODES,
    fmt: str = "otlp",
    out_dir: str | Path = "sft-from-traces",
    seed: int = 0,
    threads: int | None = None,
    epochs: int = SFT_EPOCHS,
    lr: float = SFT_LR,
    echo: Callable[[str], None] = harness.print_line,
    learn: str = "sft",
    rl_minutes: float = 10.0,
) -> dict[str, Any]:
    """Trace, import, rung base, learn from the import (`learn`: sft, or siblings on its prompts),
    rung after: the summary (also in out_dir/summary.json)."""
    started = time.monotonic()
    loads = {"before": os.getloadavg()}
    teach_pairs, eval_pairs, _ = prompt_split(seed, episodes, eval_episodes, 0)
    out = harness.fresh_out(out_dir)
    db = out / "rlproxy.db"
    path = out / ("traces.jsonl" if fmt != "otlp-proto" else "traces.pb")
    path.unlink(missing_ok=True)

    t0 = time.monotonic()
    taught, requests = trace_episodes(teach_pairs, path, fmt, seed)
    traced = rung("traced", taught, time.monotonic() - t0)
    echo(f"traced {len(taught)} episodes ({requests} model calls, mean reward {traced['mean_reward']:.3f}) "
         f"-> {path} ({fmt}, {path.stat().st_size / 1024:.0f} KiB)")  # fmt: skip
    imported = import_traces(path, db, fmt, *(["--policy", LEARNER] if learn == "siblings" else []))
    echo(f"rlproxy import: {imported['line']} ({imported['seconds']:.1f} s)")

    env = harness.serve_env(out, threads, seed, None, embedded=True) | {"RLPROXY_POLICY_POLL_INTERVAL": "0.5"}
    scorer = ScorerServer("directory").start() if learn == "siblings" else None
    extra = None if scorer is None else {
        "siblings": f"{LEARNER}=imported", "scorer": "url", "scorer_url": scorer.score_url,
        "siblings_max_share": 0.9, "groups_per_step": 4,
    }  # fmt: skip
    lines: list[str] = []
    try:
        proc, base = harness.start_server(out, model, 0, 8, env, extra=extra)
        serving_since = time.monotonic()  # the siblings service starts with serve
        client = harness.openai_client(base)
        try:
            with httpx.Client(base_url=base, timeout=30) as http:
                policy = default_model(client)  # the base model's name (never trained here)
                rungs = [evaluate(client, base, policy, "base", eval_pairs, seed, echo)]
                t0 = time.monotonic()
                if scorer is None:
                    lines = distill(out, model, policy, ["--from-source", "import"], epochs, lr, env, echo)
                    harness.wait_policy_step(http, STUDENT, 1, timeout=120)
                    learner = STUDENT
                else:  # the siblings service works on its own: wait out the minutes, then measure
                    time.sleep(max(0.0, serving_since + rl_minutes * 60 - time.monotonic()))
                    learner = LEARNER
                learn_seconds = round(time.monotonic() - t0, 1)
                served = http.get("/healthz").json().get("policies", {}).get(learner)
                # a learner with no step yet is not served under its name: its weights are the base's
                after = learner if served is not None else policy
                rungs.append(evaluate(client, base, after, "after", eval_pairs, seed, echo))
                served = served or 0
        finally:
            harness.stop_server(proc)
    finally:
        if scorer is not None:
            scorer.stop()
    done = next((x for x in lines if re.search(r"\d+ examples", x)), "")
    examples = re.search(r"(\d+) examples", done)
    loads["after"] = os.getloadavg()
    summary = {
        "task": "directory",
        "path": f"{learn} from imported traces",
        "model": model,
        "seed": seed,
        "format": fmt,
        "tracer": None if fmt == "openai-jsonl" else "openinference-instrumentation-openai",
        "traces_file": str(path),
        "traced": {k: v for k, v in traced.items() if k != "example"} | {"model_calls": requests},
        "imported": imported,
        "learn": learn,
        "sft": {
            "examples": int(examples[1]) if examples else None,
            "seconds": learn_seconds,
            "epochs": epochs,
            "learning_rate": lr,
            "line": done,
            "student_step_served": served,
        }
        if scorer is None
        else None,  # fmt: skip
        "siblings": None
        if scorer is None
        else {
            "minutes": rl_minutes,
            "seconds": learn_seconds,
            "step_served": served,
            "tally": siblings_summary(db),
            "scorer": scorer.scorer.stats(),
        },  # fmt: skip
        "rungs": [{k: v for k, v in r.items() if k != "example"} for r in rungs],
        "examples": {r["rung"]: r["example"] for r in rungs},
        "loadavg": loads,
        "minutes": round((time.monotonic() - started) / 60, 2),
        "db": str(db),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--episodes", type=int, default=TEACHER_EPISODES, help="traced teacher episodes")
    ap.add_argument("--eval", type=int, default=EVAL_EPISODES, help="fresh prompts per rung")
    ap.add_argument("--format", choices=FORMATS, default="otlp", help="what the team's traces are written as")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=SFT_EPOCHS)
    ap.add_argument("--learning-rate", type=float, default=SFT_LR)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out-dir", default="sft-from-traces")
    ap.add_argument("--learn", choices=("sft", "siblings"), default="sft",
                    help="sft on the imported answers, or siblings on the imported prompts")  # fmt: skip
    ap.add_argument("--rl-minutes", type=float, default=10.0, help="--learn siblings: minutes, serve on")
    ap.add_argument("--fast", action="store_true", help="the tiny random model, 4 episodes, 4 prompts")
    a = ap.parse_args()
    if a.fast:
        a.model, a.episodes, a.eval = "tiny", 4, 4
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} uptime: {os.getloadavg()}")
    s = run(a.model, a.episodes, a.eval, a.format, a.out_dir, a.seed, a.threads, a.epochs, a.learning_rate,
            learn=a.learn, rl_minutes=a.rl_minutes)  # fmt: skip
    sft, sib, (before, after) = s["sft"], s["siblings"], s["rungs"]
    if sft is not None:
        print(
            f"\n{s['model']}: {s['imported']['runs']} imported traces ({s['format']}); one SFT step on "
            f"{sft['examples']} conversations ({sft['epochs']} epochs) in {sft['seconds']:.0f} s"
        )
    else:
        g = sib["tally"]["sibling_groups"]
        groups = f"{g['made']} made, {g['scored']} scored, {g['trained']} trained, {g['skipped']} skipped"
        print(
            f"\n{s['model']}: {s['imported']['calls']} imported prompts ({s['format']}); step "
            f"{sib['step_served']} served after {sib['seconds']:.0f} s; sibling groups: {groups}"
        )
    print("\n".join(table(s["rungs"])))
    gain = after["mean_reward"] - before["mean_reward"]
    print(f"after - base: reward {gain:+.3f} on {after['episodes']} fresh prompts; {s['minutes']:.1f} min")
    print(f"uptime after: {s['loadavg']['after']}; summary: {Path(a.out_dir) / 'summary.json'}")


if __name__ == "__main__":
    main()
