"""Issue 14, item 1: several `rlproxy serve` replicas on one PostgreSQL, any request of a run on any replica.

Real `serve` processes on a fresh database of the session's PostgreSQL (tests/pg.py):

- stub upstream, no trainer: 20 runs x 5 turns at once, each run's turns alternating between the
  two replicas -> every run holds seq 0..4 exactly once; 50 times two different rewards for one run
  posted at the same moment to the two replicas -> one 200 and one 409, and the 200's value stored.
- the tiny model on an embedded engine per replica, trainer on in both: one trains (the other logs
  that it stands by), the step is served by both (`X-Policy-Step`, the other through its poll,
  which loads the adapter into its own engine); kill -9 of the leader -> the other takes over and
  commits the next step exactly once, and a replica started again stands by and serves that step.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from proxy_helpers import ROOT, free_port
from sqlalchemy.engine import make_url

BIN = Path(sys.executable).parent


class Replica:
    """One `rlproxy serve` subprocess; its output lines are collected by a thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                str(BIN / "rlproxy"),
                "serve",
                "--port",
                str(self.port),
                "--no-access-log",
                "--log-level",
                "info",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_line(self, needle: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.proc.poll() is not None and not any(needle in x for x in self.lines):
                break
            time.sleep(0.05)
        raise AssertionError(f"no {needle!r} line (exit {self.proc.poll()}):\n{''.join(self.lines[-40:])}")

    def has(self, needle: str) -> bool:
        return any(needle in x for x in list(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


async def _pg(url: str, sql: str, *args: object) -> list:
    import asyncpg

    u = make_url(url)
    conn = await asyncpg.connect(
        host=u.host, port=u.port, user=u.username, password=u.password, database=u.database
    )
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


@pytest.fixture
def pg_db(pg_server_url: str) -> str:
    """A fresh database on the session's PostgreSQL, dropped after the test."""
    name = f"rlproxy_r_{uuid.uuid4().hex[:10]}"
    asyncio.run(_pg(pg_server_url, f'CREATE DATABASE "{name}"'))
    url = make_url(pg_server_url).set(database=name).render_as_string(hide_password=False)
    yield url
    asyncio.run(_pg(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def stub_url() -> str:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "stub_upstream.py"),
            "--port",
            str(free_port()),
            "--delay",
            "0.002",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "stub upstream at" in line, line
    yield line.split(" at ", 1)[1].split()[0]
    proc.kill()
    proc.wait(10)


def _env(tmp_path: Path, name: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "RLPROXY_CACHE_DIR": str(tmp_path / f"cache-{name}"),  # each its own journal, as on two hosts
        **extra,
    }


def test_seq_and_rewards_across_two_replicas(tmp_path: Path, pg_db: str, stub_url: str) -> None:
    args = ["--backend", "vllm", "--upstream", stub_url, "--model", "stub-model", "--no-train", "--db", pg_db]
    replicas = [Replica(args, _env(tmp_path, n)) for n in "ab"]
    try:
        for r in replicas:
            r.wait_line("OPENAI_BASE_URL=")
        asyncio.run(_seq_and_rewards([r.base for r in replicas], pg_db))
    finally:
        for r in replicas:
            r.stop()


async def _seq_and_rewards(bases: list[str], db: str) -> None:
    clients = [httpx.AsyncClient(base_url=b, timeout=30) for b in bases]
    try:
        # 20 runs x 5 turns at once; turn t of run r on replica (r + t) % 2, each turn after the last
        async def run(r: int) -> None:
            for t in range(5):
                body = {"model": "stub-model", "messages": [{"role": "user", "content": f"run {r} turn {t}"}]}
                resp = await clients[(r + t) % 2].post(
                    "/v1/chat/completions", json=body, headers={"X-Run-Id": f"run-{r}"}
                )
                assert resp.status_code == 200, resp.text

        await asyncio.gather(*(run(r) for r in range(20)))
        # a reward is acknowledged once its replica's completions are committed; the other replica's
        # are committed within its flush interval: wait for them (the test is about numbering)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows = await _pg(db, "SELECT run_id, seq FROM completions ORDER BY run_id, seq")
            if len(rows) >= 100:
                break
            await asyncio.sleep(0.1)
        seqs: dict[str, list[int]] = defaultdict(list)
        for row in rows:
            seqs[row["run_id"]].append(row["seq"])
        assert len(rows) == 100 and len(seqs) == 20
        bad = {k: v for k, v in seqs.items() if v != [0, 1, 2, 3, 4]}
        assert not bad, f"runs whose seq is not 0..4 once each: {bad}"
        counters = {r["id"]: r["next_seq"] for r in await _pg(db, "SELECT id, next_seq FROM runs")}
        assert set(counters.values()) == {5}
        # seq is commit order; with each turn sent after the last answer it is also request order
        # unless a commit took longer than the next model call (reported, not asserted: timing)
        turns = await _pg(
            db, "SELECT run_id, request->'messages'->0->>'content' AS c FROM completions ORDER BY run_id, seq"
        )
        order: dict[str, list[int]] = defaultdict(list)
        for row in turns:
            order[row["run_id"]].append(int(row["c"].rsplit(" ", 1)[1]))
        swapped = sum(v != sorted(v) for v in order.values())
        print(f"runs whose seq order differs from request order: {swapped}/20")

        # 50 x: one run, two different rewards at the same moment, one on each replica
        for i in range(50):
            rid = f"rw-{i}"
            body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
            resp = await clients[i % 2].post("/v1/chat/completions", json=body, headers={"X-Run-Id": rid})
            assert resp.status_code == 200
            # no wait: the other replica may not see the run yet (its reward looks again, briefly)
            a, b = await asyncio.gather(
                clients[0].post(f"/v1/runs/{rid}/reward", json={"reward": 1.0}),
                clients[1].post(f"/v1/runs/{rid}/reward", json={"reward": 2.0}),
            )
            assert sorted([a.status_code, b.status_code]) == [200, 409], (i, a.text, b.text)
            stored = (await _pg(db, "SELECT reward FROM runs WHERE id = $1", rid))[0]["reward"]
            assert stored == (1.0 if a.status_code == 200 else 2.0)
    finally:
        for c in clients:
            await c.aclose()


# --- one trainer across the fleet ------------------------------------------------------------------


def _trainer_env(tmp_path: Path, name: str) -> dict[str, str]:
    return _env(
        tmp_path,
        name,
        RLPROXY_CHECKPOINT_DIR=str(tmp_path / "checkpoints"),  # shared storage: every replica sees it
        RLPROXY_POLL_INTERVAL="0.2",
        RLPROXY_POLICY_POLL_INTERVAL="0.2",
        RLPROXY_TRAIN_THREADS="1",
        RLPROXY_ENGINE_THREADS="1",
        RLPROXY_LEARNING_RATE="1e-3",
        RLPROXY_GROUP_TIMEOUT="3600",
    )


async def _group(bases: list[str], group: str, policy: str) -> None:
    """A group of 2 runs with different rewards: run 0 on bases[0], run 1 on bases[-1]."""
    async with httpx.AsyncClient(timeout=120) as http:
        for i, reward in enumerate((1.0, 0.0)):
            base = bases[0] if i == 0 else bases[-1]
            rid = f"{group}-{i}"
            body = {
                "model": policy,
                "messages": [{"role": "user", "content": f"Task {group}: say a word."}],
                "max_tokens": 4,
                "temperature": 1.0,
                "seed": i,
            }
            headers = {"X-Run-Id": rid, "X-Group-Id": group}
            resp = await http.post(f"{base}/v1/chat/completions", json=body, headers=headers)
            assert resp.status_code == 200, resp.text
            resp = await http.post(f"{base}/v1/runs/{rid}/reward", json={"reward": reward})
            assert resp.status_code == 200, resp.text


async def _served_step(base: str, policy: str, want: int, timeout: float = 120) -> str:
    """The X-Policy-Step `base` answers with, once it is `want` (or the last seen at the timeout)."""
    step = ""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < deadline:
            body = {"model": policy, "messages": [{"role": "user", "content": "again"}], "max_tokens": 2}
            resp = await http.post(f"{base}/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            step = resp.headers["x-policy-step"]
            if step == str(want):
                break
            await asyncio.sleep(0.1)
    return step


async def _steps(db: str, want: int, timeout: float = 300) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = await _pg(db, "SELECT step, policy, num_runs FROM training_steps ORDER BY step")
        if len(rows) >= want:
            return rows
        await asyncio.sleep(0.2)
    return rows


def test_one_trainer_and_takeover(tmp_path: Path, pg_db: str, tiny_model_dir: Path) -> None:
    args = ["--model", str(tiny_model_dir), "--train", "--group-size", "2", "--groups-per-step", "1"]
    args += ["--db", pg_db]
    a = Replica(args, _trainer_env(tmp_path, "a"))
    b = c = None
    try:
        a.wait_line("OPENAI_BASE_URL=")
        b = Replica(args, _trainer_env(tmp_path, "b"))
        b.wait_line("OPENAI_BASE_URL=")
        assert a.has("leader: this process trains"), "".join(a.lines[-30:])
        b.wait_line("standing by: another process holds the trainer's lock", 30)
        policy = httpx.get(f"{a.base}/v1/models").json()["data"][0]["id"]

        # step 1: a group whose runs went to both replicas; only the leader (a) trains it
        asyncio.run(_group([a.base, b.base], "g1", policy))
        rows = asyncio.run(_steps(pg_db, 1))
        assert [(r["step"], r["num_runs"]) for r in rows] == [(1, 2)]
        assert asyncio.run(_served_step(a.base, policy, 1)) == "1"
        assert asyncio.run(_served_step(b.base, policy, 1)) == "1"  # through its poll + adapter load
        assert b.has("now serves step 1 (published by another process)")
        assert not b.has("leader: took over")

        # kill -9 the leader: b takes over and trains step 2 (its runs both on b)
        a.kill9()
        b.wait_line("leader: took over training", 60)
        asyncio.run(_group([b.base], "g2", policy))
        rows = asyncio.run(_steps(pg_db, 2))
        assert [(r["step"], r["num_runs"]) for r in rows] == [(1, 2), (2, 2)]
        assert asyncio.run(_served_step(b.base, policy, 2)) == "2"
        status = asyncio.run(_pg(pg_db, "SELECT id, status, trained_step FROM runs WHERE id LIKE 'g%'"))
        assert {r["id"]: (r["status"], r["trained_step"]) for r in status} == {
            "g1-0": ("trained", 1),
            "g1-1": ("trained", 1),
            "g2-0": ("trained", 2),
            "g2-1": ("trained", 2),
        }

        # the killed replica comes back: it stands by and serves the step b published
        c = Replica(args, _trainer_env(tmp_path, "a"))
        c.wait_line("OPENAI_BASE_URL=")
        c.wait_line("standing by", 30)
        assert asyncio.run(_served_step(c.base, policy, 2)) == "2"
        assert len(asyncio.run(_pg(pg_db, "SELECT step FROM training_steps"))) == 2  # exactly once
    finally:
        for r in (a, b, c):
            if r is not None:
                r.stop()


async def test_poll_loads_the_adapter_before_serving_it() -> None:
    """A replica without the trainer: a new step is served only once its adapter loaded into this
    replica's upstream; a load that fails keeps the old step and is tried again at the next poll."""
    from rlproxy.errors import AdapterError
    from rlproxy.proxy.policies import Policies

    class Backend:
        def __init__(self) -> None:
            self.loaded: list[tuple[str, str]] = []
            self.fail = True

        async def load_adapter(self, name: str, path: str) -> None:
            if self.fail:
                raise AdapterError("checkpoint folder not readable here", status=400)
            self.loaded.append((name, path))

    backend, policies = Backend(), Policies("base")
    await policies.set_step("agent", 1)
    await policies.catch_up({"agent": (2, "/ck/agent/step-0002")}, backend)
    assert policies.step("agent") == 1 and backend.loaded == []
    backend.fail = False
    await policies.catch_up({"agent": (2, "/ck/agent/step-0002")}, backend)
    assert policies.step("agent") == 2 and backend.loaded == [("agent@2", "/ck/agent/step-0002")]
    await policies.catch_up({"agent": (2, "/ck/agent/step-0002")}, backend)  # nothing new: no reload
    assert len(backend.loaded) == 1
