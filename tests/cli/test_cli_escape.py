"""Issue 22 case 13: stored text printed to a terminal cannot drive it. An app's message holding
ESC sequences (clear the screen, set the title, OSC 52 write the clipboard) or a C1 control is shown
as `\\xNN` by `rlproxy runs show`, `rlproxy runs`, and `rlproxy sql` tables and `--vertical`;
`--json` and `--csv` are data and stay raw. Today's code printed them raw everywhere."""

from __future__ import annotations

import json
import sqlite3

import pytest
from cli_helpers import sample_db
from typer.testing import CliRunner

from rlproxy.cli.main import app
from rlproxy.cli.output import safe

runner = CliRunner()
# (no NUL in it: SQLite's JSON functions stop at one)
EVIL = "hi\x1b[2J\x1b]0;pwned\x07\x1b]52;c;ZXZpbA==\x07\x9bX\x01end\ttab\nline2"


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = sample_db(tmp_path_factory.mktemp("cli-escape") / "sample.db")
    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO runs (id, group_id, policy, status, split, next_seq, created_at) "
            "VALUES ('evil', ?, 'p', 'open', 'train', 1, '2026-12-01 10:00:00')",
            ("g\x1b[31m",),
        )
        conn.execute(
            "INSERT INTO completions (run_id, seq, policy, endpoint, request, response, status, status_code, "
            "created_at) VALUES ('evil', 0, 'p', 'chat.completions', ?, ?, 'ok', 200, '2026-12-01 10:00:00')",
            (
                json.dumps({"messages": [{"role": "user", "content": EVIL}]}),
                json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok\x1bc"}}]}),
            ),
        )
    return str(path)


def _raw_controls(text: str) -> set[str]:
    return {ch for ch in text if (ord(ch) < 32 and ch not in "\n\t") or 0x7F <= ord(ch) <= 0x9F}


def test_safe_escapes_c0_and_c1_but_newline_and_tab():
    assert safe("a\x1b[2Jb\x9b\x00\x7f\tc\nd") == "a\\x1b[2Jb\\x9b\\x00\\x7f\tc\nd"


def test_runs_show_escapes_stored_text(db):
    out = runner.invoke(app, ["runs", "show", "evil", "--db", db])
    assert out.exit_code == 0, out.output
    assert not _raw_controls(out.output), sorted(_raw_controls(out.output))
    assert "hi\\x1b[2J\\x1b]0;pwned\\x07\\x1b]52;c;ZXZpbA==\\x07\\x9bX\\x01end\ttab" in out.output
    assert "line2" in out.output and "ok\\x1bc" in out.output and "g\\x1b[31m" in out.output


@pytest.mark.parametrize("mode", [[], ["--vertical"], ["--wide"]], ids=["table", "vertical", "wide"])
def test_sql_tables_escape_stored_text(db, mode):
    out = runner.invoke(app, ["sql", "SELECT content FROM messages WHERE run_id = 'evil'", "--db", db, *mode])
    assert out.exit_code == 0, out.output
    assert not _raw_controls(out.output) and "\\x1b]52;c;" in out.output


def test_runs_table_escapes_group_ids(db):
    out = runner.invoke(app, ["runs", "--db", db])
    assert out.exit_code == 0 and not _raw_controls(out.output) and "g\\x1b[31m" in out.output


def test_json_and_csv_stay_raw_data(db):
    query = "SELECT content FROM messages WHERE run_id = 'evil' AND role = 'user'"
    out = runner.invoke(app, ["sql", query, "--db", db, "--json"])
    assert json.loads(out.output)["content"] == EVIL
    out = runner.invoke(app, ["sql", query, "--db", db, "--csv"])
    assert "\x1b]52;c;ZXZpbA==\x07" in out.output
