"""Every user mistake ends with one `error: ...` line on stderr and a non-zero exit, never a
traceback (the real `rlproxy` program, in a subprocess); `--debug` shows the traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import sample_db

RLPROXY = str(Path(sys.executable).parent / "rlproxy")


@pytest.fixture(scope="module")
def dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("cli-errors")
    (tmp / "empty.db").touch()
    (tmp / "text.db").write_text("not a database\n")
    import sqlite3

    with sqlite3.connect(tmp / "other.db") as conn:  # a SQLite database rlproxy did not make
        conn.execute("CREATE TABLE t (x)")
    return {
        "good": str(sample_db(tmp / "good.db")),
        "empty": str(tmp / "empty.db"),
        "text": str(tmp / "text.db"),
        "other": str(tmp / "other.db"),
        "missing": str(tmp / "no" / "such.db"),
        "dir": str(tmp),
    }


# (arguments with {name} standing for a database path, exit code, what the line must say)
MISTAKES = [
    (["runs", "--db", "{missing}"], 1, "no database at"),
    (["runs", "--db", "{empty}"], 1, "is not an rlproxy database"),
    (["runs", "--db", "{other}"], 1, "is not an rlproxy database"),
    (["runs", "--db", "{text}"], 1, "file is not a database"),
    (["runs", "--db", "{dir}"], 1, "is a folder, not a database file"),
    (["runs", "--db", "nosuchdialect://x/y"], 1, "cannot open nosuchdialect://x/y"),
    (["runs", "--db", "{good}", "--status", "nosuch"], 2, "Invalid value for '--status'"),
    (["runs", "--db", "{good}", "--limit", "0"], 2, "Invalid value for '--limit'"),
    (["runs", "--db", "{good}", "--limit", "-5"], 2, "Invalid value for '--limit'"),
    (["runs", "show", "nosuch", "--db", "{good}"], 1, "no run 'nosuch'"),
    (["steps", "--db", "{good}", "--limit", "0"], 2, "Invalid value for '--limit'"),
    (["steps", "--db", "{missing}"], 1, "no database at"),
    (["sql", "SELEC 1", "--db", "{good}"], 1, "syntax error"),
    (["sql", "SELECT * FROM nosuch", "--db", "{good}"], 1, "no such table: nosuch"),
    (["sql", "DELETE FROM runs", "--db", "{good}"], 1, "read-only"),
    (["sql", "SELECT 1", "--db", "{text}"], 1, "file is not a database"),
    (["sql", "--file", "{dir}/missing.sql", "--db", "{good}"], 1, "No such file or directory"),
    (["sql", "SELECT 1", "--json", "--csv", "--db", "{good}"], 2, "pick one of"),
    (["sql", "SELECT 1", "--timeout", "0", "--db", "{good}"], 2, "Invalid value for '--timeout'"),
    (["export", "--format", "csv", "--out", "{dir}/x", "--db", "{good}"], 2, "Invalid value for '--format'"),
    (["export", "--format", "jsonl", "--db", "{good}"], 2, "Missing option '--out'"),
    (
        ["export", "--format", "jsonl", "--out", "{dir}/x.jsonl", "--where", "1 +", "--db", "{good}"],
        1,
        "error",
    ),
    (["dashboard", "--db", "{missing}"], 1, "no database at"),
    (["serve", "--port", "70000"], 2, "Invalid value for '--port'"),
    (["serve", "--backend", "nosuch"], 2, "Invalid value for '--backend'"),
    (["nosuch"], 2, "No such command 'nosuch'"),
    (["models", "prepare", "nosuch"], 2, "Invalid value for 'name'"),
]


@pytest.mark.parametrize(
    ("args", "code", "says"), MISTAKES, ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_one_line_and_non_zero_exit(dbs, args, code, says):
    argv = [a.format(**dbs) for a in args]
    done = subprocess.run(
        [RLPROXY, *argv], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    lines = done.stderr.splitlines()
    assert done.returncode == code, (done.returncode, done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert says in lines[0], lines[0]
    assert "Traceback" not in done.stdout + done.stderr


def test_empty_query_from_stdin(dbs):
    done = subprocess.run(
        [RLPROXY, "sql", "--db", dbs["good"]], input="  \n", capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "empty" in done.stderr


def test_debug_shows_the_traceback(dbs):
    done = subprocess.run(
        [RLPROXY, "--debug", "runs", "--db", dbs["missing"]], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "NotAStore" in done.stderr


@pytest.mark.parametrize(
    ("env", "args", "says"),
    [
        (
            {"RLPROXY_PORT": "abc"},
            ["runs", "--db", "{good}"],
            "port (RLPROXY_PORT): Input should be a valid integer",
        ),
        ({"RLPROXY_SQL_TIMEOUT": "soon"}, ["sql", "SELECT 1", "--db", "{good}"], "RLPROXY_SQL_TIMEOUT"),
        ({"RLPROXY_DB_URL": "{missing}"}, ["steps"], "no database at {missing}"),
    ],
)
def test_bad_environment_is_one_line(dbs, env, args, says):
    import os

    environ = {**os.environ, **{k: v.format(**dbs) for k, v in env.items()}}
    argv = [a.format(**dbs) for a in args]
    done = subprocess.run([RLPROXY, *argv], capture_output=True, text=True, timeout=120, env=environ)
    lines = done.stderr.splitlines()
    assert done.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert says.format(**dbs) in lines[0], lines[0]


def test_slow_query_is_interrupted(dbs):
    forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    done = subprocess.run(
        [RLPROXY, "sql", forever, "--timeout", "0.3", "--db", dbs["good"]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "error: interrupted (the statement ran past the time limit: --timeout / RLPROXY_SQL_TIMEOUT)"
    ]
