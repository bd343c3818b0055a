"""`rlproxy runs` and `runs show` say why a run was skipped (issue 56): `status_reason` was only in SQL."""

from __future__ import annotations

import sqlite3

from cli_helpers import sample_db
from typer.testing import CliRunner

from rlproxy.cli import main

runner = CliRunner()


def test_a_skipped_run_shows_its_reason(tmp_path):
    db = sample_db(tmp_path / "s.db")
    with sqlite3.connect(db) as conn:
        (run_id,) = conn.execute("SELECT id FROM runs ORDER BY created_at DESC LIMIT 1").fetchone()
        conn.execute(
            "UPDATE runs SET status = 'skipped', status_reason = 'zero_variance' WHERE id = ?", (run_id,)
        )
    out = runner.invoke(main.app, ["runs", "--db", str(db), "--status", "skipped"])
    assert out.exit_code == 0, out.output
    assert "skipped (zero_variance)" in out.output
    shown = runner.invoke(main.app, ["runs", "show", run_id, "--db", str(db)])
    assert shown.exit_code == 0 and "status skipped (zero_variance)" in shown.output, shown.output
