"""`bench/sft_from_traces.py --fast` end to end, so the script that measures issue 58's SFT figure
cannot rot: the team's traces written by OpenInference and the OTel SDK, `rlproxy import`, the rungs
on `rlproxy serve` (tiny model) around `rlproxy sft --from-source import`. The plumbing, not the
learning: the tiny random model learns nothing; the figure is measured on SmolLM2 (docs/traces.md).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rlproxy.demo.directory import TOOLS
from rlproxy.demo.rungs import COMPONENTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_fast_sft_from_traces(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "RLPROXY_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sft_from_traces.py"), "--fast", "--threads", "1",
         "--out-dir", str(out)],
        env=env, capture_output=True, text=True, timeout=850,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "uptime" in done.stdout and "after - base: reward" in done.stdout
    summary = json.loads((out / "summary.json").read_text())

    # the instrumentation's file: a trace per episode, each the episode's span and its model calls'
    spans = [
        span
        for line in (out / "traces.jsonl").read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    assert len({s["traceId"] for s in spans}) == 4
    llm = [s for s in spans if s["name"] != "directory episode"]
    assert len(llm) == 12 == summary["traced"]["model_calls"]  # the expert: two lookups and an answer
    assert summary["traced"]["mean_reward"] == 1.0

    # imported: a run per trace, text only, never a GRPO sample
    assert (summary["imported"]["calls"], summary["imported"]["runs"]) == (12, 4)
    con = sqlite3.connect(out / "rlproxy.db")
    assert con.execute(
        "SELECT count(DISTINCT c.run_id), count(*), sum(c.token_ids IS NULL), min(r.status) "
        "FROM completions c JOIN runs r ON r.id = c.run_id WHERE c.source = 'import'"
    ).fetchone() == (4, 12, 12, "skipped")

    # one SFT step from the imports (a conversation per trace), served as student@1
    assert con.execute("SELECT policy, step, kind FROM training_steps").fetchall() == [("student", 1, "sft")]
    assert summary["sft"]["examples"] == 4 and summary["sft"]["student_step_served"] == 1

    # both rungs measured on the 4 fresh prompts, as validation runs of the base model and the student
    assert [r["rung"] for r in summary["rungs"]] == ["base", "after"]
    for r in summary["rungs"]:
        assert r["episodes"] == 4 and all(0.0 <= r[c] <= 1.0 for c in (*COMPONENTS, "mean_reward"))
    val = "SELECT policy, count(*) FROM runs WHERE split = 'val' AND status = 'validated' GROUP BY 1"
    rungs = dict(con.execute(val).fetchall())  # the base model's name, and the student
    assert len(rungs) == 2 and rungs["student"] == 4 and sum(rungs.values()) == 8


@pytest.mark.parametrize(("fmt", "calls"), [("otlp-proto", 9), ("openai-jsonl", 3)])
def test_the_other_formats_import_whole_conversations(fmt: str, calls: int, tmp_path: Path) -> None:
    """`--format otlp-proto` (the same spans, length-delimited protobuf) and `openai-jsonl` (a line
    per episode): a run per episode, each one conversation with the tool calls, results and tools."""
    sys.path.insert(0, str(ROOT))  # bench/ is not a package of ours: import it from the checkout
    from bench.sft_from_traces import import_traces, trace_episodes

    pairs = [("Alice", "Bob"), ("Carol", "Jack"), ("Emma", "Frank")]
    episodes, requests = trace_episodes(pairs, tmp_path / "traces", fmt, seed=0)
    assert [e.reward for e in episodes] == [1.0] * 3 and requests == 9
    imported = import_traces(tmp_path / "traces", tmp_path / "s.db", fmt)
    assert (imported["calls"], imported["runs"]) == (
        calls,
        3,
    )  # OTLP: a span per call; JSONL: a line per episode
    con = sqlite3.connect(tmp_path / "s.db")
    last = (  # each run's last call: its whole conversation
        "SELECT request, response FROM completions c WHERE source = 'import' "
        "AND seq = (SELECT max(seq) FROM completions WHERE run_id = c.run_id)"
    )
    finals = [(json.loads(q), json.loads(a)) for q, a in con.execute(last)]
    assert len(finals) == 3
    for request, response in finals:
        roles = [m["role"] for m in request["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
        assert request["tools"] == TOOLS
        assert response["choices"][0]["message"]["content"].count(":") == 2  # the answer: two extensions


@pytest.mark.timeout(900)
def test_fast_siblings_from_imported_prompts(tmp_path: Path, cache_dir: Path) -> None:
    """`--learn siblings`: the imported prompts, stored under `agent`, answered K times by the engine
    and scored by the task's checker over HTTP; no app request but the rungs'."""
    out = tmp_path / "out"
    env = {**os.environ, "RLPROXY_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sft_from_traces.py"), "--fast", "--threads", "1",
         "--learn", "siblings", "--rl-minutes", "1", "--out-dir", str(out)],
        env=env, capture_output=True, text=True, timeout=850,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft"] is None and [r["rung"] for r in summary["rungs"]] == ["base", "after"]
    groups = summary["siblings"]["tally"]["sibling_groups"]
    assert groups["made"] > 0 and groups["failed"] == 0
    assert summary["siblings"]["scorer"]["calls"] > 0
    con = sqlite3.connect(out / "rlproxy.db")
    made = con.execute(
        "SELECT count(*), min(c.source), min(g.reason) FROM sibling_groups g "
        "JOIN completions c ON c.id = g.completion_id"
    ).fetchone()
    assert made == (groups["made"], "import", "imported")  # every group branched an imported call
