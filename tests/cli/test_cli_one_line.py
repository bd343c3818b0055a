"""One line, never a traceback (issue 26, item 5): a busy port, `sft`/`fork` on a database that does
not exist (they created an empty one), `fork` of a pruned step (`...: None`), and `sft` without
--model on a policy trained from another base (the checkpoint records its base). Each failed today."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import sample_db
from typer.testing import CliRunner

from rlproxy.cli import main

runner = CliRunner()


def _one_error_line(out: Any) -> str:
    assert "Traceback" not in out.output, out.output
    lines = [ln for ln in out.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.output
    return lines[0]


def _sft_result(step: int) -> dict[str, Any]:
    """What `run_sft` returns for a step (the fakes below stand in for the training)."""
    return {
        "step": step,
        "loss/total": 1.0,
        "sft/token_accuracy": 0.5,
        "sft/examples": 1,
        "adapter_path": "x",
    }


def test_busy_port_is_one_line_before_anything_loads(tmp_path):
    db = sample_db(tmp_path / "s.db")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = runner.invoke(main.app, ["dashboard", "--db", str(db), "--port", str(port)])
        assert out.exit_code == 2
        assert f"127.0.0.1:{port} is in use" in _one_error_line(out)
        out = runner.invoke(main.app, ["serve", "--model", "/nonexistent-model", "--port", str(port)])
        assert out.exit_code == 2 and "is in use" in _one_error_line(out)  # before the model is looked for


@pytest.mark.parametrize(
    "args",
    [["sft", "--policy", "p", "--file", "{chats}", "--publish"], ["fork", "p@1", "q"]],
    ids=["sft", "fork"],
)
def test_sft_and_fork_refuse_a_missing_database(tmp_path, args):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
    )
    typo = tmp_path / "typo.db"
    argv = [a.replace("{chats}", str(chats)) for a in args] + ["--db", str(typo)]
    out = runner.invoke(main.app, argv)
    assert out.exit_code == 2 and f"no database at {typo}" in _one_error_line(out)
    assert not typo.exists()


def test_fork_of_a_pruned_step_says_so(tmp_path):
    import sqlite3

    db = sample_db(tmp_path / "s.db")
    with sqlite3.connect(db) as conn:
        policy, step = conn.execute(
            "SELECT policy, step FROM training_steps ORDER BY step LIMIT 1"
        ).fetchone()
        conn.execute("UPDATE training_steps SET adapter_path = NULL")  # what keep_checkpoints does
    out = runner.invoke(
        main.app,
        ["fork", f"{policy}@{step}", "newp", "--db", str(db), "--checkpoint-dir", str(tmp_path / "ck")],
    )
    assert out.exit_code == 1
    line = _one_error_line(out)
    assert "pruned by keep_checkpoints" in line and not line.rstrip().endswith("None"), line


def test_sft_takes_the_base_model_from_the_checkpoint(tmp_path, monkeypatch, tiny_model_dir: Path):
    from rlproxy.cli import processes

    db = sample_db(tmp_path / "s.db")
    step = tmp_path / "ck" / "p" / "step-0003"
    step.mkdir(parents=True)
    (step / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    seen: list[Any] = []

    async def fake_sft(settings: Any, *_: Any, **__: Any) -> dict[str, Any]:
        seen.append(settings.model)
        return _sft_result(4)

    monkeypatch.setattr(processes, "run_sft", fake_sft)
    chats = tmp_path / "c.jsonl"
    chats.write_text("{}\n")
    argv = [
        "sft",
        "--policy",
        "p",
        "--file",
        str(chats),
        "--publish",
        "--db",
        str(db),
        "--checkpoint-dir",
        str(tmp_path / "ck"),
    ]
    out = runner.invoke(main.app, argv)
    assert out.exit_code == 0, out.output
    assert seen == [str(tiny_model_dir)]
    out = runner.invoke(main.app, [*argv, "--model", "tiny"])  # an explicit --model wins
    assert out.exit_code == 0 and seen[-1] == "tiny"


@pytest.mark.parametrize("into", ["..", "."])
def test_sft_into_a_name_outside_the_checkpoint_folder_is_refused(tmp_path, monkeypatch, into: str):
    """Issue 55: `sft --into ..` wrote its step beside the checkpoint folder (`ck/../step-0001`)."""
    from rlproxy.cli import processes
    from rlproxy.errors import TrainerError
    from rlproxy.trainer.checkpoint import policy_dir

    db = sample_db(tmp_path / "s.db")
    ran: list[Any] = []

    async def fake_sft(*args: Any, **kwargs: Any) -> dict[str, Any]:
        ran.append(kwargs)
        return _sft_result(1)

    monkeypatch.setattr(processes, "run_sft", fake_sft)
    chats = tmp_path / "c.jsonl"
    chats.write_text("{}\n")
    base = ["--file", str(chats), "--db", str(db), "--checkpoint-dir", str(tmp_path / "ck")]
    out = runner.invoke(main.app, ["sft", "--policy", "p", "--into", into, *base])
    assert out.exit_code == 2 and "no policy name" in _one_error_line(out)
    out = runner.invoke(main.app, ["sft", "--policy", into, "--publish", *base])
    assert out.exit_code == 2 and "no policy name" in _one_error_line(out)
    out = runner.invoke(main.app, ["fork", "p@1", into, "--db", str(db), "--checkpoint-dir", str(tmp_path)])
    assert out.exit_code == 2 and "no policy name" in _one_error_line(out)
    assert ran == []
    with pytest.raises(TrainerError):
        policy_dir(tmp_path / "ck", into)
    assert policy_dir(tmp_path / "ck", "../x") == tmp_path / "ck" / ".._x"  # one folder, inside
