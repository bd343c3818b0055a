"""`rlproxy export`: the storage sample written as JSONL, Parquet and a `datasets` folder by the real
CLI, then loaded back the way TRL users load data (`datasets.load_dataset`, `load_from_disk`)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import cli_helpers
import pytest

from rlproxy.storage.export import record

RLPROXY = str(Path(sys.executable).parent / "rlproxy")
ALL_RUNS = ["a", "b", "c", "d", "e", "f"]  # the sample's runs, oldest first


@pytest.fixture
def sample_db(tmp_path: Path) -> Path:
    return cli_helpers.sample_db(tmp_path / "sample.db")


def export(db: Path, fmt: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [RLPROXY, "export", "--format", fmt, "--out", str(out), "--db", str(db), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_records_are_openai_chat_with_reward_and_tokens(sample_db, tmp_path):
    out = tmp_path / "runs.jsonl"
    done = export(sample_db, "jsonl", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote 6 runs to {out} (jsonl)"
    rows = jsonl(out)
    assert [r["run_id"] for r in rows] == ALL_RUNS
    by_id = {r["run_id"]: r for r in rows}

    # messages are the trajectories view's, with the keys chat templates read
    view = dict(sqlite3.connect(sample_db).execute("SELECT run_id, messages FROM trajectories").fetchall())
    for r in rows:
        expected = json.loads(view[r["run_id"]])
        if r["run_id"] == "d":  # sent as text parts: exported as the one string the model saw
            assert expected[0]["content"] == [
                {"type": "text", "text": "Describe"},
                {"type": "text", "text": " this."},
            ]
            expected[0]["content"] = "Describe this."
        assert [(m["role"], m.get("content")) for m in r["messages"]] == [
            (m["role"], m.get("content")) for m in expected
        ]
        assert r["prompt"] + r["completion"] == r["messages"]
    a = by_id["a"]
    assert a["reward"] == 1.0 and a["group_id"] == "g1" and a["status"] == "trained"
    assert [m["role"] for m in a["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert a["messages"][2]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert a["messages"][3]["tool_call_id"] == "call_a"
    assert a["completion"] == [{"role": "assistant", "content": "It is sunny in Paris."}]
    assert [c["seq"] for c in a["completions"]] == [0, 1]
    assert a["completions"][0]["token_ids"] == [1, 2]  # choice 0 of the stored [[1, 2]]
    assert a["completions"][1]["prompt_tokens"] == 40
    assert "tools" not in a and "metadata" not in a  # null keys are left out of a line
    # an open run without a reward, from the text completions route: no chat messages
    f = by_id["f"]
    assert "reward" not in f and f["messages"] == [] and f["completions"][0]["token_ids"] == [1, 2]
    # the failed last call of run c: the conversation ends with the tool results, no completion
    assert by_id["c"]["completion"] == [] and by_id["c"]["messages"][-1]["role"] == "tool"


def test_where_selects_runs_and_bad_sql_is_one_line(sample_db, tmp_path):
    out = tmp_path / "trained.jsonl"
    done = export(sample_db, "jsonl", out, "--where", "status = 'trained' AND reward > 0")
    assert done.returncode == 0, done.stderr
    assert [r["run_id"] for r in jsonl(out)] == ["a", "c"]

    bad = tmp_path / "bad.jsonl"
    done = export(sample_db, "jsonl", bad, "--where", "reward >>> 1")
    assert done.returncode == 1
    assert done.stderr.splitlines() == ['error: near ">": syntax error']
    assert list(tmp_path.glob("bad.jsonl*")) == []  # no file, no half-written part

    done = export(sample_db, "jsonl", out)  # out exists
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "--force" in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_round_trip_into_datasets(sample_db, tmp_path):
    datasets = pytest.importorskip("datasets", reason="pip install 'rlproxy[export]' (the dev extra has it)")
    cache = tmp_path / "hf-cache"  # nothing is written to ~/.cache

    out = tmp_path / "runs.jsonl"
    assert export(sample_db, "jsonl", out).returncode == 0
    from_json = datasets.load_dataset("json", data_files=str(out), split="train", cache_dir=str(cache))
    assert from_json["run_id"] == ALL_RUNS
    first = from_json[0]["messages"][0]
    assert (first["role"], first["content"]) == ("system", "You are a weather agent.")
    assert from_json[0]["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"

    parquet = tmp_path / "runs.parquet"
    done = export(sample_db, "parquet", parquet, "--where", "reward IS NOT NULL")
    assert done.returncode == 0, done.stderr
    from_parquet = datasets.load_dataset(
        "parquet", data_files=str(parquet), split="train", cache_dir=str(cache)
    )
    assert from_parquet["run_id"] == ["a", "b", "c", "d", "e"]
    assert from_parquet["reward"] == [1.0, 0.0, 0.5, 1.0, 1.0]

    folder = tmp_path / "runs-hf"
    done = export(sample_db, "hf", folder)
    assert done.returncode == 0, done.stderr
    ds = datasets.load_from_disk(str(folder))
    assert ds["run_id"] == ALL_RUNS
    assert {"messages", "prompt", "completion", "reward", "completions", "tools"} <= set(ds.column_names)
    a = ds[0]
    assert [m["role"] for m in a["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert a["completion"][0]["content"] == "It is sunny in Paris."
    assert a["completions"][0]["token_ids"] == [1, 2]
    d = ds[3]  # content sent as text parts: one string, as the embedded engine joins it for the model
    assert d["messages"][0]["content"] == "Describe this."


def test_trl_columns_render_with_a_chat_template(sample_db, tmp_path, tiny_tokenizer):
    """TRL's SFT reads `messages`; GRPO `prompt`; the conversational prompt-completion trainers
    `prompt` + `completion`: each renders with the model's chat template as TRL renders it."""
    out = tmp_path / "runs.jsonl"
    assert export(sample_db, "jsonl", out, "--where", "status = 'trained'").returncode == 0
    rendered = []
    for r in jsonl(out):
        if not r["completion"]:  # run c: its last call failed, the conversation ends with tool results
            continue
        full = tiny_tokenizer.apply_chat_template(r["messages"], tokenize=False)
        prompt = tiny_tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        assert full.startswith(prompt) and r["completion"][0]["content"] in full[len(prompt) :]
        rendered.append(r["run_id"])
    assert rendered == ["a", "b"]
    try:
        from trl.data_utils import is_conversational, maybe_apply_chat_template
    except ImportError:  # TRL is the bench extra's; the checks above are what it does
        return
    row = {k: v for k, v in jsonl(out)[0].items() if k in ("prompt", "completion")}
    assert is_conversational(row)
    rendered = maybe_apply_chat_template(row, tiny_tokenizer)
    assert rendered["completion"].startswith("It is sunny in Paris.")


def test_record_takes_choice_zero_of_tokens_and_logprobs():
    run = {"id": "r", "group_id": "g", "reward": 0.5, "status": "completed"}
    comp = {
        "seq": 0,
        "request": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        "prompt_token_ids": [5, 6],
        "token_ids": [[7, 8], [9]],
        "logprobs": [[-0.5, None], [-1.0]],
    }
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "refusal": None}]
    rec = record(run, json.dumps(msgs), [comp])
    assert rec["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert rec["tools"] == [{"type": "function"}]
    assert rec["completions"][0] == {
        "seq": 0,
        "policy_step": None,
        "adapter": None,
        "status": None,
        "finish_reason": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "prompt_token_ids": [5, 6],
        "token_ids": [7, 8],
        "logprobs": [-0.5, None],
    }


async def test_records_and_steps_on_every_store(sample_engine):
    """The same records and step rows from SQLite and PostgreSQL (the views differ, the output not)."""
    from rlproxy.storage.export import records
    from rlproxy.storage.queries import step_table

    recs = [r async for r in records(sample_engine)]
    assert [r["run_id"] for r in recs] == ALL_RUNS
    assert [m["role"] for m in recs[0]["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert recs[0]["created_at"] == "2026-01-01T12:00:00+00:00"
    chosen = [r["run_id"] async for r in records(sample_engine, "reward > 0.6 AND policy = 'p'")]
    assert chosen == ["a", "d", "e"]
    steps = await step_table(sample_engine)
    assert [(s["policy"], s["step"], s["kind"], s["kl"]) for s in steps] == [
        ("p", 1, "grpo", None),
        ("q", 1, "grpo", None),
        ("p", 2, "grpo", None),
    ]
    assert [s["step"] for s in await step_table(sample_engine, policy="p", limit=1)] == [2]


def test_text_parts_join_and_other_parts_stay():
    text_parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    image = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    msgs = [{"role": "user", "content": text_parts}, {"role": "user", "content": image}]
    rec = record({"id": "r"}, msgs, [])
    assert [m["content"] for m in rec["messages"]] == ["ab", image]
    assert rec["prompt"] == rec["messages"] and rec["completion"] == []  # no reply: all prompt
