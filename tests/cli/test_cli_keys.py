"""`rlproxy keys create | list | revoke` on a real SQLite store (the CLI in a subprocess; PostgreSQL:
tests/proxy/test_keys_replicas.py)."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
from pathlib import Path

RLPROXY = str(Path(sys.executable).parent / "rlproxy")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RLPROXY, "keys", *args], capture_output=True, text=True, timeout=120)


def test_create_list_revoke(tmp_path: Path) -> None:
    db = str(tmp_path / "rlproxy.db")  # no store yet: create brings one to head
    made = cli("create", "--name", "shop-agent", "--policies", "shop,cart", "--rpm", "60", "--db", db)
    assert made.returncode == 0, made.stderr
    secret = made.stdout.split(": ", 1)[1].split()[0]
    assert secret.startswith("rk-") and len(secret) > 40
    with sqlite3.connect(db) as con:
        row = con.execute("SELECT name, secret_hash, policies, rpm, tpm FROM keys").fetchone()
    assert row == ("shop-agent", hashlib.sha256(secret.encode()).hexdigest(), '["shop","cart"]', 60, None)
    again = cli("create", "--name", "shop-agent", "--db", db)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "exists already" in again.stderr
    listed = cli("list", "--db", db)
    assert listed.returncode == 0 and "shop-agent" in listed.stdout and "shop,cart" in listed.stdout
    assert secret not in listed.stdout and "rk-" not in listed.stdout
    assert cli("revoke", "shop-agent", "--db", db).returncode == 0
    gone = cli("revoke", "shop-agent", "--db", db)
    assert gone.returncode == 2 and gone.stderr.startswith("error: ") and "no valid key" in gone.stderr
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT revoked_at IS NOT NULL FROM keys").fetchone() == (1,)
