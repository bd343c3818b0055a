"""`rlproxy import` of OpenAI chat JSONL, Langfuse and LangSmith records, then SFT's selection of them.

The records are made by the libraries, not by hand: the chat.completion comes from a real `openai`
client against the stub upstream; Langfuse's are its SDK's API models (`ObservationV2`,
`Score_Numeric`, dumped as the public API sends them); LangSmith's its SDK's `schemas.Run` and
`schemas.Feedback` (their `inputs`/`outputs` as `wrap_openai` records them: the call's keyword
arguments and the chat.completion), dumped with `model_dump_json`. No server of either is run.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import openai
import pytest
from traced import MESSAGES, TOOLS
from typer.testing import CliRunner

from rlproxy.cli.main import app
from rlproxy.storage.db import create_engine, normalize_url
from rlproxy.storage.export import select_run_ids
from rlproxy.storage.training import load_runs
from rlproxy.trainer.offline import sft_condition
from rlproxy.trainer.sft import conversations

runner = CliRunner()
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def completion(stub) -> dict:
    client = openai.OpenAI(base_url=stub.url + "/v1", api_key="sk-test")
    return client.chat.completions.create(
        model="stub-model", messages=MESSAGES, tools=TOOLS, temperature=0.5
    ).model_dump()


def imported(path: Path, db: Path, *args: str) -> str:
    out = runner.invoke(app, ["import", str(path), "--db", str(db), *args])
    assert out.exit_code == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def runs(db: Path) -> list[dict]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        query = (
            "SELECT r.id, r.reward, r.reward_source, r.metrics, r.status, c.request, c.response, "
            "c.created_at, c.source FROM runs r JOIN completions c ON c.run_id = r.id ORDER BY r.id"
        )
        return [dict(r) for r in conn.execute(query)]


def check_call(row: dict, completion: dict) -> None:
    request = json.loads(row["request"])
    assert request["messages"] == MESSAGES and request["tools"] == TOOLS
    reply = json.loads(row["response"])["choices"][0]["message"]
    assert reply["content"] == completion["choices"][0]["message"]["content"]
    assert row["source"] == "import" and row["status"] == "skipped"


def the_scored_run(path: Path, completion: dict, run_id: str, reward: tuple[float, str]) -> dict:
    """The one run `path` imports into a new store, checked: its call, its id, its reward and source."""
    db = path.with_suffix(".db")
    assert imported(path, db).startswith("imported 1 call(s) in 1 new run(s), 1 scored")
    [row] = runs(db)
    check_call(row, completion)
    assert row["id"] == run_id and (row["reward"], row["reward_source"]) == reward
    return row


def test_openai_chat_jsonl(completion, tmp_path):
    reply = {k: v for k, v in completion["choices"][0]["message"].items() if v not in (None, [])}
    path = tmp_path / "chats.jsonl"
    stored = {**completion, "request": {"model": "stub-model", "messages": MESSAGES, "tools": TOOLS}}
    finetune = {"messages": [*MESSAGES, reply], "tools": TOOLS}
    path.write_text(json.dumps(stored) + "\n" + json.dumps(finetune) + "\n")
    db = tmp_path / "s.db"
    assert imported(path, db).startswith("imported 2 call(s) in 2 new run(s)")
    rows = runs(db)
    assert {r["id"] for r in rows} >= {f"import:{completion['id']}"}
    for row in rows:
        check_call(row, completion)
    assert "2 already there" in imported(path, db)


def test_langfuse_export(completion, tmp_path):
    from langfuse.api import ObservationV2, Score_Numeric

    trace = uuid.uuid4().hex
    generation = ObservationV2(
        id="gen-1",
        trace_id=trace,
        project_id="proj",
        type="GENERATION",
        name="OpenAI-generation",
        start_time=T0,
        end_time=T0 + timedelta(seconds=1),
        model="stub-model",
        model_parameters={"temperature": 0.5},
        input={"messages": MESSAGES, "tools": TOOLS},  # as Langfuse's OpenAI integration records a call
        output=completion["choices"][0]["message"],
        usage_details={"input": 5, "output": 8},
    )
    span = ObservationV2(id="span-1", trace_id=trace, project_id="proj", type="SPAN", start_time=T0)
    score = Score_Numeric(
        id="s-1", trace_id=trace, name="helpfulness", value=0.75, source="API",
        timestamp=T0, created_at=T0, updated_at=T0, environment="default",
    )  # fmt: skip
    path = tmp_path / "langfuse.jsonl"
    page = {"data": [json.loads(generation.json()), json.loads(span.json())], "meta": {"page": 1}}
    path.write_text(score.json() + "\n" + json.dumps(page) + "\n")  # a score before its trace's calls
    row = the_scored_run(path, completion, f"import:{trace}", (0.75, "langfuse"))
    assert json.loads(row["metrics"]) == {"helpfulness": 0.75}
    assert row["created_at"].startswith("2026-12-01 12:00:00")


def test_langsmith_export(completion, tmp_path):
    from langsmith import schemas

    root, llm = uuid.uuid4(), uuid.uuid4()
    chain = schemas.Run(id=root, trace_id=root, name="agent", run_type="chain", start_time=T0, inputs={})
    call = schemas.Run(
        id=llm,
        trace_id=root,
        parent_run_id=root,
        name="ChatOpenAI",
        run_type="llm",
        start_time=T0,
        end_time=T0 + timedelta(seconds=1),
        inputs={"messages": MESSAGES, "tools": TOOLS, "model": "stub-model", "temperature": 0.5},
        outputs=completion,
        extra={"metadata": {"ls_model_name": "stub-model"}},
    )
    feedback = schemas.Feedback(
        id=uuid.uuid4(),
        run_id=root,
        trace_id=root,
        key="correctness",
        score=1.0,
        created_at=T0,
        modified_at=T0,
    )
    path = tmp_path / "langsmith.jsonl"
    path.write_text("".join(r.model_dump_json() + "\n" for r in (chain, call, feedback)))
    the_scored_run(path, completion, f"import:{root}", (1.0, "langsmith"))


def imported_chat(completion: dict, tmp_path: Path) -> tuple[Path, dict]:
    """A store holding one imported fine-tuning line (the client's messages + the reply it got)."""
    reply = {k: v for k, v in completion["choices"][0]["message"].items() if v not in (None, [])}
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [*MESSAGES, reply], "tools": TOOLS}) + "\n")
    imported(path, tmp_path / "s.db")
    return tmp_path / "s.db", reply


def test_sft_from_source_import_selects_the_imported_conversations(completion, tmp_path):
    """`rlproxy sft --from-source import`: the selection and the conversations distillation learns."""
    db, reply = imported_chat(completion, tmp_path)

    async def selected() -> list:
        engine = create_engine(normalize_url(str(db)))
        try:
            ids = await select_run_ids(engine, *sft_condition(None, None, None, False, from_source="import"))
            none = await select_run_ids(engine, *sft_condition(None, None, None, False, from_source="hosted"))
            assert none == []
            return await load_runs(engine, ids)
        finally:
            await engine.dispose()

    [run] = asyncio.run(selected())
    [(messages, tools)] = conversations(run)
    assert messages[: len(MESSAGES)] == MESSAGES and messages[-1]["content"] == reply["content"]
    assert tools == TOOLS


def test_sft_from_source_import_trains_a_step(completion, tiny_model_dir, tmp_path, monkeypatch):
    """`rlproxy sft --policy student --from-source import`: the imported chats are learned (tiny model)."""
    db, _ = imported_chat(completion, tmp_path)
    monkeypatch.setenv("RLPROXY_TRAIN_THREADS", "1")
    args = ["--db", str(db), "--model", str(tiny_model_dir), "--checkpoint-dir", str(tmp_path / "ck")]
    out = runner.invoke(app, ["sft", "--policy", "student", "--from-source", "import", *args])
    assert out.exit_code == 0, out.output
    assert "step 1 of student-distilled (sft)" in out.stdout and "1 examples" in out.stdout
