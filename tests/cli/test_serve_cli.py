"""The command line: db upgrade, sql (read-only), runs, the sqlite3 CLI on our views, serve."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from rlproxy.cli.main import app

runner = CliRunner()
BIN = Path(sys.executable).parent


@pytest.fixture
def filled_db(make_proxy, stub) -> Path:
    """A database the proxy wrote: two runs, one rewarded, one request without a run."""
    proxy = make_proxy(stub.url)
    chat = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
    for run in ("a", "a", "b"):
        httpx.post(f"{proxy.url}/v1/chat/completions", json=chat, headers={"X-Run-Id": run})
    httpx.post(f"{proxy.url}/v1/chat/completions", json=chat)
    assert httpx.post(f"{proxy.url}/v1/runs/a/reward", json={"reward": 0.25}).status_code == 200
    proxy.stop()
    return proxy.db_path


def _settled(db: Path) -> bytes:
    """The file's bytes once everything in its write-ahead log is in it (a read-write connection of
    the test's own, the proxy stopped): what a later checkpoint could change is then nothing."""
    con = sqlite3.connect(db)
    try:
        busy, _, _ = con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert busy == 0, "another connection still holds the store"
    finally:
        con.close()
    return db.read_bytes()


def _pages_differ(before: bytes, after: bytes, page: int = 4096) -> list[int]:
    n = max(len(before), len(after))
    return [i // page + 1 for i in range(0, n, page) if before[i : i + page] != after[i : i + page]]


def test_db_upgrade_creates_the_schema(tmp_path):
    db = tmp_path / "new.db"
    result = runner.invoke(app, ["db", "upgrade", "--db", str(db)])
    assert result.exit_code == 0, result.output
    out = runner.invoke(
        app, ["sql", "SELECT name FROM sqlite_master WHERE type='view' ORDER BY name", "--db", str(db)]
    )
    assert out.exit_code == 0 and "messages" in out.output and "trajectories" in out.output


def test_sql_prints_a_table_and_json_lines(filled_db):
    out = runner.invoke(
        app, ["sql", "SELECT id, status, reward FROM runs ORDER BY id", "--db", str(filled_db)]
    )
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].split() == ["id", "status", "reward"]
    assert lines[2].split() == ["a", "completed", "0.25"] and "(2 rows)" in out.output
    out = runner.invoke(
        app, ["sql", "SELECT id, reward FROM runs ORDER BY id", "--db", str(filled_db), "--json"]
    )
    assert [json.loads(line) for line in out.output.splitlines()] == [
        {"id": "a", "reward": 0.25},
        {"id": "b", "reward": None},
    ]


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO runs (id, status, created_at) VALUES ('x', 'open', '2026-01-01')",
        "UPDATE runs SET reward = 9",
        "DELETE FROM completions",
        "DROP TABLE runs",
        "PRAGMA user_version = 7",
        "ATTACH DATABASE 'other.db' AS other",
    ],
)
def test_sql_refuses_writes(filled_db, statement, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _settled(filled_db)
    out = runner.invoke(app, ["sql", statement, "--db", str(filled_db)])
    assert out.exit_code != 0
    assert "error" in out.output.lower()
    wal = Path(f"{filled_db}-wal")
    assert not wal.exists() or wal.stat().st_size == 0, "the read-only connection wrote a log"
    after = filled_db.read_bytes()
    assert after == before, f"pages changed: {_pages_differ(before, after)} of {len(before) // 4096}"
    assert not (tmp_path / "other.db").exists()


def test_runs_table(filled_db):
    out = runner.invoke(app, ["runs", "--db", str(filled_db), "--status", "completed"])
    assert out.exit_code == 0, out.output
    assert any(line.startswith("a ") and "completed" in line for line in out.output.splitlines())
    assert "(1 row)" in out.output


def test_sqlite3_cli_reads_trajectories(filled_db):
    sqlite3_bin = shutil.which("sqlite3")
    if sqlite3_bin is None:
        pytest.skip("Debian's sqlite3 CLI is not installed here (apt-get install sqlite3; CI installs it)")
    out = subprocess.run(
        [sqlite3_bin, str(filled_db), "SELECT * FROM trajectories"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) == 2
    out = subprocess.run(
        [sqlite3_bin, str(filled_db), "SELECT count(*) FROM messages"], capture_output=True, text=True
    )
    assert out.returncode == 0 and int(out.stdout) > 0


def test_settings_read_env_and_options_override(monkeypatch):
    from rlproxy.cli.main import make_settings

    monkeypatch.setenv("RLPROXY_PORT", "9123")
    monkeypatch.setenv("RLPROXY_GROUP_SIZE", "6")
    s = make_settings(port=None, group_size=3, db_url="/tmp/x.db")
    assert s.port == 9123 and s.group_size == 3 and s.db_url == "sqlite+aiosqlite:////tmp/x.db"


def test_serve_end_to_end(tiny_model_dir, tmp_path):
    """`rlproxy serve` with the embedded engine prints the base URL line, then serves the SDK."""
    env = {**os.environ, "RLPROXY_ENGINE_THREADS": "1", "RLPROXY_CACHE_DIR": str(tiny_model_dir.parents[1])}
    db = tmp_path / "serve.db"
    proc = subprocess.Popen(
        [
            str(BIN / "rlproxy"),
            "serve",
            "--model",
            str(tiny_model_dir),
            "--no-train",
            "--port",
            "0",
            "--db",
            str(db),
            "--no-access-log",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        base = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if "OPENAI_BASE_URL=" in line:
                base = line.split("OPENAI_BASE_URL=", 1)[1].strip()
                break
        assert base and base.endswith("/v1"), "serve did not print the OPENAI_BASE_URL line"
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        resp = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_headers={"X-Run-Id": "serve-1"},
        )
        assert resp.choices[0].message.content is not None
    finally:
        proc.terminate()
        proc.wait(30)
    out = runner.invoke(app, ["sql", "SELECT run_id, status FROM completions", "--db", str(db), "--json"])
    assert json.loads(out.output.splitlines()[0]) == {"run_id": "serve-1", "status": "ok"}


def test_train_runs_until_sigterm(stub, tmp_path):
    """`rlproxy train` attaches to the upstream, runs the trainer, and exits cleanly on SIGTERM."""
    env = {**os.environ, "RLPROXY_DB_URL": str(tmp_path / "t.db")}
    proc = subprocess.Popen(
        [str(BIN / "rlproxy"), "train", "--upstream", stub.url, "--model", "stub-model"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or "trainer running" in line:
                break
        assert "trainer running" in line
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_engine_serves_the_model_alone(tiny_model_dir):
    from proxy_helpers import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            str(BIN / "rlproxy"),
            "engine",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        models = None
        while time.monotonic() < deadline and models is None:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
            except httpx.HTTPError:
                time.sleep(0.3)
        assert models and models["data"][0]["id"] == "tiny"
    finally:
        proc.terminate()
        proc.wait(30)
