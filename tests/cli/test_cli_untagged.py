"""`rlproxy runs` shows untagged traffic (issue 26, item 2): a count under the runs table, and
`--untagged` lists the requests with the reply id that rewards them. Today's code showed neither."""

from __future__ import annotations

import json
import sqlite3

import pytest
from cli_helpers import sample_db
from typer.testing import CliRunner

from rlproxy.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = sample_db(tmp_path_factory.mktemp("cli-untagged") / "sample.db")
    with sqlite3.connect(path) as conn:  # two more requests without a run key, as the writer stores them
        for i in (1, 2):
            conn.execute(
                "INSERT INTO completions (run_id, seq, policy, endpoint, request, response, status, "
                "status_code, finish_reason, prompt_tokens, completion_tokens, created_at) VALUES "
                "(NULL, NULL, 'p', 'chat.completions', ?, ?, 'ok', 200, 'stop', 9, 3, ?)",
                (
                    json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                    json.dumps({"id": f"chatcmpl-untagged-{i}", "choices": []}),
                    f"2026-12-01 10:0{i}:00.000000",
                ),
            )
    return str(path)


def test_runs_counts_untagged_requests(db):
    out = runner.invoke(app, ["runs", "--db", db])
    assert out.exit_code == 0, out.output
    assert "and 3 requests without a run id (no X-Run-Id): `rlproxy runs --untagged` lists them" in out.output


def test_runs_untagged_lists_them_newest_first(db):
    out = runner.invoke(app, ["runs", "--untagged", "--db", db])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].split()[:3] == ["reply_id", "created_at", "policy"]
    assert [ln.split()[0] for ln in lines[2:4]] == ["chatcmpl-untagged-2", "chatcmpl-untagged-1"]
    assert "2026-12-01T10:02:00+00:00" in lines[2] and lines[-1] == "(3 rows)"  # the sample holds one more
    bad = runner.invoke(app, ["runs", "--untagged", "--status", "open", "--db", db])
    assert bad.exit_code == 2 and "untagged requests have none" in bad.output


def test_dashboard_refuses_to_serve_beyond_loopback_without_a_key(db):
    """Issue 22 case 14: `rlproxy dashboard --host 0.0.0.0` without a key served every run silently."""
    out = runner.invoke(app, ["dashboard", "--db", db, "--host", "0.0.0.0"], env={"RLPROXY_ADMIN_KEY": ""})
    assert out.exit_code == 2, out.output
    assert "without a key: give --admin-key" in out.output and "Traceback" not in out.output
