"""The writer in a process of its own (storage/writer_link.py, writer_process.py; issue 24).

The writer's own tests (test_writer.py) run here again with every writer in process mode, on real
SQLite files and PostgreSQL: the same rules hold whichever side of a socket the SQL runs on. Then
what only a process can do: die (kill -9) under load and be replaced, with every operation sent
again and nothing stored twice; and end with the proxy that started it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from test_writer import (  # noqa: F401  (collected again here, every writer in a process)
    rec,
    rows,
    test_a_flush_with_nothing_to_write_commits_no_transaction,
    test_a_reward_joins_the_batch_being_gathered,
    test_backlog_over_max_queue_makes_room_wait,
    test_close_drains,
    test_concurrent_submits_gapless_seq,
    test_flush_is_a_barrier,
    test_queue_is_capped_in_bytes_and_room_ends_in_503,
    test_reward_flushes_the_runs_completions_first,
    test_reward_not_committed_in_time_is_withdrawn,
    test_reward_outcomes,
    test_run_rows,
    test_two_writers_share_a_run,
    test_unserializable_record_is_stored_as_an_error,
)

from rlproxy.storage.db import create_engine, sqlite_path
from rlproxy.storage.journal import Journal
from rlproxy.storage.writer import Writer
from rlproxy.storage.writer_process import ProcessRunner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_a_process(monkeypatch: pytest.MonkeyPatch):
    """Every Writer made during the test writes from a process, and does (checked after the test)."""
    made: list[Writer] = []
    init = Writer.__init__

    def in_a_process(self: Writer, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("process", True)
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Writer, "__init__", in_a_process)
    yield
    assert made and all(isinstance(w.runner, ProcessRunner) for w in made)
    assert all(w.runner.child is not None and w.runner.child.returncode() == 0 for w in made if w._closed)


async def test_a_killed_writer_process_is_replaced_and_nothing_is_lost_or_stored_twice(
    engine: AsyncEngine,
) -> None:
    w = Writer(engine, flush_interval=0.01, max_batch=16)
    await w.start()
    first = w.runner.child.proc.pid
    outcomes = []
    for i in range(300):
        w.submit(rec(f"r{i % 10}", i))
        if i % 30 == 29:
            outcomes.append(asyncio.ensure_future(w.reward(f"r{(i // 30)}", 1.0, timeout=30)))
        if i == 150:
            os.kill(first, signal.SIGKILL)  # mid-stream: some batches committed, some not
        await asyncio.sleep(0.001)
    assert await asyncio.gather(*outcomes) == [True] * 10
    await w.close()
    assert w.runner.child.proc.pid != first and w.restarts == 1
    assert w.dropped == 0 and w.depth == 0
    got = await rows(engine, "SELECT run_id, seq FROM completions ORDER BY run_id, seq")
    assert len(got) == 300  # once each, though everything unsettled was sent again
    by_run: dict[str, list[int]] = {}
    for run_id, seq in got:
        by_run.setdefault(run_id, []).append(seq)
    assert all(seqs == list(range(30)) for seqs in by_run.values())
    assert await rows(engine, "SELECT count(*) FROM runs WHERE reward = 1.0") == [(10,)]


@pytest.mark.parametrize("db_kind", ["sqlite"])  # holds SQLite's write lock from another connection
async def test_failed_writes_are_retried_by_the_writer_process(migrated_url: str) -> None:
    """test_writer's case, once the writer process is up (it starts in about a second, longer than
    that test's lock is held): its failed attempts reach the proxy's counters, nothing is lost."""
    engine = create_engine(migrated_url, busy_timeout_ms=50)
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    await w.flush()  # the process is up
    locked, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        con = sqlite3.connect(sqlite_path(migrated_url), isolation_level=None)
        con.execute("BEGIN IMMEDIATE")
        locked.set()
        release.wait(10)
        con.execute("COMMIT")
        con.close()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    await asyncio.to_thread(locked.wait)
    try:
        for i in range(20):
            w.submit(rec("r", i))
        reward = asyncio.ensure_future(w.reward("r", 1.0, timeout=30))
        for _ in range(200):  # the failed attempts are counted while they go on
            if w.write_errors and w.last_error:
                break
            await asyncio.sleep(0.02)
        assert w.write_errors >= 1 and "locked" in w.last_error
        release.set()
        assert await reward is True
        await w.close()
        assert w.dropped == 0 and w.last_error is None
        assert await rows(engine, "SELECT seq FROM completions ORDER BY seq") == [(i,) for i in range(20)]
    finally:
        release.set()
        holder.join()
        await engine.dispose()


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_the_writer_process_ends_with_the_proxy_and_the_journal_keeps_its_records(
    migrated_url: str, tmp_path: Path
) -> None:
    """kill -9 of the process that started it: the writer process exits at once (no orphan holding
    the store), and what it had not committed is replayed from the journal by the next start."""
    script = f"""
import asyncio, sys
sys.path.insert(0, {str(ROOT / "tests" / "storage")!r})
from test_writer import rec
from rlproxy.storage.db import create_engine
from rlproxy.storage.db import create_engine, sqlite_path
from rlproxy.storage.journal import Journal
from rlproxy.storage.writer import Writer

async def main():
    w = Writer(create_engine({migrated_url!r}), flush_interval=30, journal=Journal({str(tmp_path / "j")!r}),
               process=True)
    await w.start()
    for i in range(50):
        w.submit(rec("r", i))
    await asyncio.sleep(0.3)
    print(w.runner.child.proc.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        try:
            os.waitpid(child, os.WNOHANG)  # not ours to reap: the check is that it is gone
        except ChildProcessError:
            pass
        if Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.05)
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z", "the writer process outlived the proxy"

    async def replay() -> tuple[int, list[tuple]]:
        from rlproxy.storage.db import create_engine

        engine = create_engine(migrated_url)
        w = Writer(engine, journal=Journal(tmp_path / "j"))
        await w.start()
        n = await w.recover(timeout=30)
        await w.close()
        got = await rows(engine, "SELECT seq FROM completions ORDER BY seq")
        await engine.dispose()
        return n, got

    n, got = asyncio.run(replay())
    assert n == 50 and got == [(i,) for i in range(50)]
