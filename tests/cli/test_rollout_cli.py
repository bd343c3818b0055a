"""`rlproxy rollout status | promote | rollback` on a real SQLite store (the CLI in a subprocess)."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path

from rlproxy.storage import rollouts as store
from rlproxy.storage.db import create_engine, upgrade

RLPROXY = str(Path(sys.executable).parent / "rlproxy")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RLPROXY, "rollout", *args], capture_output=True, text=True, timeout=120)


def _open(db: Path, policy: str, step: int) -> None:
    async def go() -> None:
        engine = create_engine(f"sqlite+aiosqlite:///{db}")
        try:
            await store.begin(engine, policy, step, 0.2)
        finally:
            await engine.dispose()

    with sqlite3.connect(db) as con:
        con.execute(
            "INSERT INTO training_steps (step, policy, adapter_path, kind) VALUES (?, ?, ?, 'grpo')",
            (step, policy, f"/ck/{step}"),
        )
    asyncio.run(go())


def test_status_promote_rollback(tmp_path: Path) -> None:
    db = tmp_path / "rlproxy.db"
    upgrade(f"sqlite+aiosqlite:///{db}")
    res = cli("promote", "--db", str(db))
    assert res.returncode != 0 and "no open rollout" in res.stderr
    _open(db, "agent", 1)
    _open(db, "other", 1)
    res = cli("rollback", "--db", str(db))
    assert res.returncode != 0 and "several open rollouts (agent, other)" in res.stderr
    res = cli("status", "--db", str(db))
    assert res.returncode == 0, res.stderr
    assert "candidate_step" in res.stdout and "rollout 1 (open) now: candidate 0 rewarded runs" in res.stdout
    res = cli("promote", "--db", str(db), "--policy", "agent", "--reason", "looks fine")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "agent@1 promoted (incumbent was @0)"
    res = cli("rollback", "--db", str(db), "--policy", "other")
    assert res.stdout.strip() == "other@1 rolled back (incumbent was @0)"
    with sqlite3.connect(db) as con:
        got = con.execute("SELECT policy, status, decided_by, reason FROM rollouts ORDER BY id").fetchall()
    assert got == [
        ("agent", "promoted", "manual", "looks fine"),
        ("other", "rolled_back", "manual", "rolled back by hand"),
    ]
    res = cli("rollback", "--db", str(db), "--policy", "agent")  # decided already: nothing open
    assert res.returncode != 0 and "no open rollout of policy 'agent'" in res.stderr
