"""Issue 55 on PostgreSQL: two `rlproxy serve` replicas on one store, two apps with two keys.

Keys made and revoked with the real `rlproxy keys` command on that store; each app's run, reward and
reply are its own whichever replica it reaches, another app's are 404 on both, and a revoke is in
force on both replicas within the keys' refresh (2 s).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path

import httpx
from test_replicas import BIN, Replica, _env, _pg, pg_db, stub_url  # noqa: F401  (fixtures)

MSG = [{"role": "user", "content": "hi"}]


def _keys(*args: str, db: str) -> str:
    out = subprocess.run(
        [str(BIN / "rlproxy"), "keys", *args, "--db", db], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _chat(base: str, auth: dict, run_id: str | None = None) -> httpx.Response:
    headers = {**auth, **({"X-Run-Id": run_id} if run_id else {})}
    body = {"model": "stub-model", "messages": MSG}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_two_apps_on_two_replicas(tmp_path: Path, pg_db: str, stub_url: str) -> None:  # noqa: F811
    made = {}
    for name in ("app-a", "app-b", "app-c"):
        line = _keys("create", "--name", name, "--policies", "stub-model", db=pg_db)
        made[name] = {"Authorization": "Bearer " + re.search(r"(rk-\S+)", line).group(1)}
    a, b = made["app-a"], made["app-b"]
    args = ["--backend", "vllm", "--upstream", stub_url, "--model", "stub-model", "--no-train", "--db", pg_db]
    env = {"RLPROXY_API_KEY": "shared", "RLPROXY_ADMIN_KEY": "admin"}
    one, two = (Replica(args, _env(tmp_path, n, **env)) for n in "ab")
    try:
        for r in (one, two):
            r.wait_line("OPENAI_BASE_URL=")
        assert _chat(one.base, a, "r1").status_code == 200  # A's run, on replica one
        assert _chat(two.base, b, "r1").status_code == 200  # B's run of the same name, on two
        for base in (one.base, two.base):  # neither app reaches the other's, on either replica
            for auth in (a, b):  # (the other replica commits within its flush interval)
                deadline = time.monotonic() + 10
                while (got := httpx.get(f"{base}/v1/runs/r1", headers=auth, timeout=30)).status_code == 404:
                    assert time.monotonic() < deadline, got.text
                    time.sleep(0.1)
                assert got.status_code == 200 and len(got.json()["completions"]) == 1, got.text
        # A rewards its run on the other replica; B's run stays open
        done = httpx.post(f"{two.base}/v1/runs/r1/reward", json={"reward": 1.0}, headers=a, timeout=30)
        assert done.status_code == 200 and done.json()["run_id"] == "r1", done.text
        rows = asyncio.run(_pg(pg_db, "SELECT r.status, k.name FROM runs r JOIN keys k ON k.id = r.key_id"))
        assert sorted((row["name"], row["status"]) for row in rows) == [
            ("app-a", "completed"),
            ("app-b", "open"),
        ]
        # a reply of A is not C's to reward, on either replica (the stub repeats its id)
        assert _chat(one.base, a).status_code == 200
        for base in (one.base, two.base):
            theirs = httpx.post(
                f"{base}/v1/completions/cmpl-stub/reward", json={"reward": 1}, headers=made["app-c"]
            )
            assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "reply_not_found"
        # the canary view is valid on PostgreSQL and holds no pinned run
        assert asyncio.run(_pg(pg_db, "SELECT count(*) AS n FROM rollout_runs"))[0]["n"] == 0
        # a revoke reaches both replicas within the refresh
        _keys("revoke", "app-a", db=pg_db)
        deadline = time.monotonic() + 6
        while any(_chat(base, a).status_code != 401 for base in (one.base, two.base)):
            assert time.monotonic() < deadline, "a revoked key still served after 6 s"
            time.sleep(0.2)
        assert _chat(one.base, b).status_code == 200 and _chat(two.base, b).status_code == 200
        listed = _keys("list", db=pg_db)
        assert "app-a" in listed and "app-b" in listed and "rk-" not in listed
    finally:
        for r in (one, two):
            r.stop()
