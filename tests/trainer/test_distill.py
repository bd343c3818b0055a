"""Distillation from the store: a (hosted) teacher's conversations become the student's SFT step.

`rlproxy sft --policy student --from-policy teacher`: the teacher's rows (text only, no token ids,
as a hosted provider leaves them) are rendered with the student's chat template, tools and tool
calls included, only the assistant turns learned; validation runs never; `--min-reward` filters; the
step is published to a new policy (`--into`, default `student-distilled`) so the student's live
traffic is not switched. Before this, `rlproxy sft --where` on those rows found "no stored tokens".
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from rlproxy.demo.directory import SYSTEM, TOOLS, expert
from rlproxy.errors import ConfigError
from rlproxy.inference.tools import messages_for_template
from rlproxy.storage.training import CompletionData, RunData
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.offline import run_sft
from rlproxy.trainer.sft import chat_example, conversations, distill_examples

PEOPLE = [("Alice", "Frank"), ("Bob", "Carol"), ("David", "Emma"), ("Grace", "Henry")]


def teacher_calls(a: str, b: str) -> list[dict[str, Any]]:
    """The three calls of one directory episode answered by the scripted teacher, stored as the proxy
    stores a hosted row: request as sent, reply as received, no token ids."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What are the phone extensions of {a} and {b}?"},
    ]
    from rlproxy.demo.directory import lookup

    out = []
    for _ in range(3):
        request = {"model": "gpt-4o-mini", "messages": [dict(m) for m in messages], "tools": TOOLS}
        reply = expert(request)
        out.append(
            {
                "source": "hosted",
                "request": request,
                "response": {"choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]},
                "prompt_token_ids": None,
                "token_ids": None,
                "logprobs": None,
            }
        )
        messages.append(reply)
        if reply.get("tool_calls"):
            call = reply["tool_calls"][0]
            result, _ = lookup(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
    return out


def _run(calls: list[dict[str, Any]]) -> RunData:
    comps = [
        CompletionData(
            "r", i, 0, "chat.completions", c["request"], c["response"], None, None, None, "ok", "hosted"
        )
        for i, c in enumerate(calls)
    ]
    return RunData("r", "g", "teacher", 1.0, comps)


def test_a_run_is_one_conversation_with_its_tool_calls(tiny_tokenizer: Any) -> None:
    convs = conversations(_run(teacher_calls("Alice", "Frank")))
    assert len(convs) == 1  # each call continues the one before: the last holds them all
    messages, tools = convs[0]
    assert tools == TOOLS
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert messages[-1]["content"] == "Alice: 4821, Frank: 3307"
    examples, refused = distill_examples(tiny_tokenizer, [_run(teacher_calls("Alice", "Frank"))])
    assert refused == 0 and len(examples) == 1
    ex = examples[0]
    learned = tiny_tokenizer.decode([t for t, m in zip(ex.target, ex.mask, strict=True) if m])
    context = tiny_tokenizer.decode(
        ex.context + [t for t, m in zip(ex.target, ex.mask, strict=True) if not m]
    )
    # the teacher's turns, in the student's format: both tool calls and the answer; nothing else
    assert learned.count('"name": "lookup"') == 2 and "Alice: 4821, Frank: 3307" in learned
    assert "4821" not in learned.split("Alice: 4821")[0]  # the tool's result is context, not learned
    assert '"extension": "4821"' in context and "phone extensions of Alice" in context
    # exactly what chat_example makes of the normalized messages (the template the server renders)
    same = chat_example(tiny_tokenizer, messages_for_template(messages), TOOLS)
    assert (same.context, same.target, same.mask) == (ex.context, ex.target, ex.mask)


def test_a_branch_not_continued_stays_its_own_conversation() -> None:
    calls = teacher_calls("Alice", "Frank")
    retry = json.loads(json.dumps(calls[0]))  # the app asked the first question again (a retry)
    retry["response"]["choices"][0]["message"] = {"role": "assistant", "content": "I do not know."}
    convs = conversations(_run([calls[0], retry, calls[1], calls[2]]))
    assert len(convs) == 2 and convs[0][0][-1]["content"] == "I do not know."


async def test_distill_from_the_store(
    engine: Any, db_url: str, add_run: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    for i, (a, b) in enumerate(PEOPLE):
        await add_run(
            engine, f"t{i}", group_id=f"g{i}", policy="teacher", reward=1.0, completions=teacher_calls(a, b)
        )
    await add_run(
        engine, "low", group_id="gl", policy="teacher", reward=0.2, completions=teacher_calls("Irene", "Jack")
    )
    await add_run(
        engine, "val", group_id="gv", policy="teacher", reward=1.0, completions=teacher_calls("Jack", "Bob")
    )
    await add_run(
        engine, "other", group_id="go", policy="someone", reward=1.0, completions=teacher_calls("Bob", "Jack")
    )
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE runs SET split = 'val' WHERE id = 'val'"))
    config = TrainerConfig(learning_rate=1e-3, checkpoint_dir=str(tmp_path / "ck"), train_threads=1)
    progress: list[tuple[int, int]] = []
    out = await run_sft(
        db_url,
        config,
        str(tiny_model_dir),
        "student",
        from_policy="teacher",
        min_reward=0.5,
        into="student-distilled",
        batch_size=2,
        on_step=lambda done, total, _m: progress.append((done, total)),
    )
    # 4 runs: the low-reward one, the val run and the other policy's are left out
    assert out["sft/examples"] == 4 and out["policy"] == "student-distilled" and out["step"] == 1
    assert progress == [(1, 2), (2, 2)]
    async with engine.connect() as conn:
        steps = (await conn.execute(text("SELECT policy, step, kind FROM training_steps"))).all()
    assert [tuple(s) for s in steps] == [("student-distilled", 1, "sft")]  # the student itself: untouched
    assert (tmp_path / "ck" / "student-distilled" / "step-0001" / "adapter_model.safetensors").is_file()
    # --where narrows the teacher's runs; a selection with nothing left says so
    with pytest.raises(ConfigError, match="no conversation"):
        await run_sft(
            db_url, config, str(tiny_model_dir), "student", from_policy="teacher", where="run_id = 'val'"
        )
    # the old path (exact tokens) finds nothing in text-only rows, and says so
    with pytest.raises(ConfigError, match="no stored tokens"):
        await run_sft(db_url, config, str(tiny_model_dir), "student", where="run_id = 't0'")


def test_cli_distills_into_a_new_policy(
    add_run: Any, tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    """`rlproxy sft --policy student --from-policy teacher`: progress lines, step 1 of student-distilled."""
    import asyncio

    from rlproxy.cli.main import app
    from rlproxy.storage.db import create_engine, upgrade

    db = tmp_path / "d.db"
    url = f"sqlite+aiosqlite:///{db}"
    upgrade(url)

    async def fill() -> None:
        eng = create_engine(url)
        for i, (a, b) in enumerate(PEOPLE[:2]):
            await add_run(
                eng, f"t{i}", group_id=f"g{i}", policy="teacher", reward=1.0, completions=teacher_calls(a, b)
            )
        await eng.dispose()

    asyncio.run(fill())
    monkeypatch.setenv("RLPROXY_TRAIN_THREADS", "1")
    result = CliRunner().invoke(
        app,
        [
            "sft",
            "--policy",
            "student",
            "--from-policy",
            "teacher",
            "--db",
            url,
            "--model",
            str(tiny_model_dir),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--batch-size",
            "1",
        ],  # fmt: skip
    )
    assert result.exit_code == 0, result.output
    assert "sft: optimizer step 2/2" in result.output
    assert "step 1 of student-distilled (sft)" in result.output
    con = sqlite3.connect(db)
    assert con.execute("SELECT policy, step FROM training_steps").fetchall() == [("student-distilled", 1)]
