"""Issue 22 cases 5 and 8: what /healthz says about the store, and a SQLite file gone while serving.

Real proxies under uvicorn (`make_proxy`: what `rlproxy serve` builds) on a stub upstream, and a real
`rlproxy serve` process for the start-up check.

Before issue 22: the public /healthz showed the writer's last failed SQL statement with its bound
parameters (run ids, group ids, rubric text); a SQLite file deleted while serving went unnoticed
(rewards acknowledged into an unlinked file, /healthz ok, an empty store after a restart); a
read-only `-shm` killed `serve` with SIGBUS and no log line.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
from proxy_helpers import free_port
from storage.test_writer import rec

BIN = Path(sys.executable).parent


def test_case5_healthz_shows_only_the_class_of_a_store_fault(make_proxy, stub):
    proxy = make_proxy(stub.url)
    # a store fault: another process holds SQLite's write lock, so the writer's transaction fails
    # with SQL in its message (the statement, and for a refused insert its parameters)
    locker = sqlite3.connect(proxy.db_path, timeout=0)
    locker.execute("BEGIN IMMEDIATE")
    try:
        proxy.state.writer.submit(rec("secret-run-id", 0, default_group="secret-group"))
        for _ in range(600):
            if proxy.state.writer.last_error:
                break
            time.sleep(0.05)
        assert proxy.state.writer.last_error  # the writer did fail, with the statement in its message
        body = httpx.get(f"{proxy.url}/healthz").text
        for secret in ("secret-run-id", "secret-group", "BEGIN", "SQL", "locked"):
            assert secret not in body, body
        store = httpx.get(f"{proxy.url}/healthz").json()["store"]
        assert store["last_error"] == "OperationalError"
        # the detail is on the operators' /metrics (and in the log)
        metrics = httpx.get(f"{proxy.url}/metrics").text
        assert "rlproxy_store_last_error{" in metrics and "database is locked" in metrics
    finally:
        locker.rollback()
        locker.close()


def _chat(base: str, run_id: str) -> int:
    return httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Run-Id": run_id},
    ).status_code


def test_case8_deleted_sqlite_file_stops_rewards(make_proxy, stub):
    proxy = make_proxy(stub.url)
    assert _chat(proxy.url, "r-1") == 200 and _chat(proxy.url, "r-2") == 200
    assert httpx.get(f"{proxy.url}/healthz").status_code == 200
    proxy.flush()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{proxy.db_path}{suffix}").unlink(missing_ok=True)
    health = httpx.get(f"{proxy.url}/healthz")
    assert health.status_code == 503 and health.json()["store"]["file"] == "file_missing"
    reward = httpx.post(f"{proxy.url}/v1/runs/r-1/reward", json={"reward": 0.5})
    assert reward.status_code == 503 and "Retry-After" in reward.headers, reward.text
    assert reward.json()["error"]["code"] == "store_unavailable"


def test_case8_replaced_sqlite_file_stops_rewards(make_proxy, stub, tmp_path: Path):
    proxy = make_proxy(stub.url)
    other = make_proxy(stub.url)  # another store, copied over the first one's path
    assert _chat(proxy.url, "r-1") == 200
    proxy.flush()
    other.flush()
    shutil.copy(other.db_path, tmp_path / "copy.db")
    os.replace(tmp_path / "copy.db", proxy.db_path)
    health = httpx.get(f"{proxy.url}/healthz")
    assert health.status_code == 503 and health.json()["store"]["file"] == "file_replaced"
    assert httpx.post(f"{proxy.url}/v1/runs/r-1/reward", json={"reward": 0.5}).status_code == 503


def test_case8_unwritable_shm_is_refused_at_start_not_sigbus(tmp_path: Path, stub):
    db = tmp_path / "rlproxy.db"
    # a -shm this process cannot open for writing (a chmod 444 file binds no root: a folder does)
    Path(f"{db}-shm").mkdir()
    proc = subprocess.run(
        [str(BIN / "rlproxy"), "serve", "--backend", "vllm", "--upstream", stub.url, "--model", "stub-model"]
        + ["--no-train", "--db", str(db), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RLPROXY_CACHE_DIR": str(tmp_path / "cache")},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, -7), out  # -7: SIGBUS
    assert f"{db}-shm cannot be written" in out, out
