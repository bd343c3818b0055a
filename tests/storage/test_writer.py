"""The single writer: batching, gapless seq, rewards after their completions, retries, draining."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import sys
import threading
import time
from collections import defaultdict

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.errors import StorageError
from rlproxy.storage import runner as runner_module
from rlproxy.storage.db import create_engine, sqlite_path
from rlproxy.storage.errors import RewardConflict, RunNotFound, StoreUnavailable
from rlproxy.storage.records import CompletionRecord
from rlproxy.storage.writer import Writer


def rec(run_id: str | None, i: int = 0, **kw: object) -> CompletionRecord:
    return CompletionRecord(
        run_id=run_id,
        policy=kw.pop("policy", "p"),
        default_group=kw.pop("default_group", "g-default"),
        endpoint="chat.completions",
        request={"messages": [{"role": "user", "content": f"q{i}"}], "i": i},
        response={"choices": [{"message": {"role": "assistant", "content": f"a{i}"}}]},
        token_ids=[[1, 2, 3]],
        logprobs=[[-0.1, -0.2, float("-inf")]],
        status="ok",
        status_code=200,
        **kw,
    )


async def rows(engine: AsyncEngine, sql: str, **params: object) -> list[tuple]:
    async with engine.connect() as conn:
        return [tuple(r) for r in (await conn.execute(text(sql), params)).all()]


async def test_concurrent_submits_gapless_seq(engine: AsyncEngine) -> None:
    w = Writer(engine, flush_interval=0.01, max_batch=32)
    await w.start()
    order: dict[str, list[int]] = defaultdict(list)

    async def one(i: int) -> None:
        await asyncio.sleep(random.random() * 0.05)
        run = f"run-{i % 50}"
        order[run].append(i)  # submit order within the run
        w.submit(rec(run, i))

    await asyncio.gather(*(one(i) for i in range(200)))
    await w.close()
    assert w.rows_written == 200 and w.depth == 0 and w.dropped == 0
    got = await rows(engine, "SELECT run_id, seq, request FROM completions ORDER BY run_id, seq")
    assert len(got) == 200
    by_run: dict[str, list[int]] = defaultdict(list)
    for run_id, seq, _req in got:
        by_run[run_id].append(seq)
    assert len(by_run) == 50
    assert all(seqs == list(range(len(seqs))) for seqs in by_run.values())
    # seq follows submission order within a run
    async with engine.connect() as conn:
        for run in ("run-0", "run-7"):
            res = await conn.execute(
                text("SELECT request FROM completions WHERE run_id = :r ORDER BY seq"), {"r": run}
            )
            reqs = [r[0] if isinstance(r[0], dict) else json.loads(r[0]) for r in res]
            assert [q["i"] for q in reqs] == order[run]
    assert (await rows(engine, "SELECT count(*) FROM runs"))[0][0] == 50


async def test_reward_flushes_the_runs_completions_first(engine: AsyncEngine) -> None:
    w = Writer(engine, flush_interval=30.0, max_batch=1000)  # would otherwise sit for 30 s
    await w.start()
    for i in range(5):
        w.submit(rec("r", i))
    t0 = time.monotonic()
    assert await w.reward("r", 1.5, {"acc": 1.0}, {"note": "x"}) is True
    assert time.monotonic() - t0 < 5
    assert (await rows(engine, "SELECT count(*) FROM completions WHERE run_id = 'r'"))[0][0] == 5
    ((status, reward, completed_at),) = await rows(engine, "SELECT status, reward, completed_at FROM runs")
    assert (status, reward) == ("completed", 1.5) and completed_at is not None
    await w.close()


async def test_a_reward_joins_the_batch_being_gathered(engine: AsyncEngine) -> None:
    """A reward is committed with the records that arrive while its batch gathers (within
    REWARD_WAIT_S), not in a transaction of its own (issue 24: a commit per reward was most of the
    writer's time under tagged traffic). Before: the reward ended the batch, `b` came in a second.
    (Another run's turn `x` is in the batch, as under load: a batch of the reward's own run alone
    is ended by it, the next test.)"""
    w = Writer(engine, flush_interval=0.2)
    await w.start()
    w.submit(rec("x"))
    w.submit(rec("a"))
    reward = asyncio.ensure_future(w.reward("a", 1.0))
    await asyncio.sleep(0.005)
    w.submit(rec("b"))
    assert await reward is True
    assert (w.commits, w.rows_written) == (1, 3)  # `b` came in the reward's transaction
    await w.close()


async def test_a_reward_that_finds_the_writer_idle_is_committed_at_once(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything before it is committed and nothing is coming to share its transaction: it does
    not wait for a batch (with the waits made 30 s, the old writer took 30 s). One that comes right
    after a commit (clients posting rewards back to back) waits until that commit is REWARD_GAP_S
    old; one after a pause, not at all."""
    monkeypatch.setattr(runner_module, "REWARD_WAIT_S", 30.0)
    monkeypatch.setattr(runner_module, "REWARD_GAP_S", 1.5)
    w = Writer(engine, flush_interval=30.0)
    await w.start()
    for run in ("a", "b"):
        w.submit(rec(run))
    await w.flush()
    t0 = time.monotonic()
    assert await w.reward("a", 1.0) is True  # right after the flush's commit
    t1 = time.monotonic()
    await asyncio.sleep(1.7)  # a pause longer than the gap
    t2 = time.monotonic()
    assert await w.reward("b", 1.0) is True
    t3 = time.monotonic()
    assert 1.2 <= t1 - t0 < 15, t1 - t0
    assert t3 - t2 < 1.2, t3 - t2
    assert w.commits == 3
    await w.close()


async def test_a_reward_ends_a_batch_of_its_own_runs_turns_at_once(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An app that waits for each answer, then posts the reward: nothing else is coming to share the
    transaction, so the reward does not wait for the batch (30 s here). Another run's turn in the
    batch: it waits, as a reward under load does."""
    monkeypatch.setattr(runner_module, "REWARD_WAIT_S", 30.0)
    w = Writer(engine, flush_interval=30.0)
    await w.start()
    w.submit(rec("a"))
    w.submit(rec("a"))
    t0 = time.monotonic()
    assert await w.reward("a", 1.0) is True
    assert time.monotonic() - t0 < 10
    assert (w.commits, w.rows_written) == (1, 2)
    w.submit(rec("b"))
    w.submit(rec("c"))
    reward = asyncio.ensure_future(w.reward("b", 1.0))
    await asyncio.sleep(0.5)
    assert not reward.done()  # "c" may have company coming: the batch is gathered
    await w.flush()
    assert await reward is True
    assert (w.commits, w.rows_written) == (2, 4)
    await w.close()


async def test_a_flush_with_nothing_to_write_commits_no_transaction(engine: AsyncEngine) -> None:
    """`commits` counts transactions that wrote something (`rlproxy_write_commits_total`): a flush
    that finds the queue empty (everything before it committed) opens none."""
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    await w.flush()
    assert w.commits == 0
    w.submit(rec("a"))
    await w.flush()
    assert (w.commits, w.rows_written) == (1, 1)
    await w.flush()
    await w.flush()
    assert w.commits == 1
    await w.close()
    assert w.commits == 1


async def test_reward_outcomes(engine: AsyncEngine) -> None:
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    w.submit(rec("a"))
    w.submit(rec("b"))
    w.submit(rec("c"))
    assert await w.reward("a", 1.0) is True  # new
    assert await w.reward("a", 1.0, {"x": 2.0}) is False  # the same again
    with pytest.raises(RewardConflict):  # a different one
        await w.reward("a", 0.0)
    with pytest.raises(RunNotFound):  # unknown
        await w.reward("nope", 1.0)
    with pytest.raises(ValueError):
        await w.reward("a", float("nan"))
    # a run the trainer already used: same -> False, different -> conflict, status untouched
    assert await w.reward("b", 0.5) is True
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE runs SET status = 'trained', trained_step = 1 WHERE id = 'b'"))
        await conn.execute(text("UPDATE runs SET status = 'expired' WHERE id = 'c'"))
    assert await w.reward("b", 0.5) is False
    with pytest.raises(RewardConflict):
        await w.reward("b", 0.25)
    assert await w.reward("c", 2.0) is True  # a late reward revives an expired run
    await w.close()
    got = await rows(engine, "SELECT id, status, reward, metrics FROM runs ORDER BY id")
    assert [(r[0], r[1], r[2]) for r in got] == [
        ("a", "completed", 1.0),
        ("b", "trained", 0.5),
        ("c", "completed", 2.0),
    ]
    assert got[0][3] is None  # the ignored second post did not touch metrics
    assert w.rewards_written == 3
    with pytest.raises(StorageError):  # closed
        await w.reward("a", 1.0)


async def test_run_rows(engine: AsyncEngine) -> None:
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    w.submit(rec("explicit", group_id="G1", default_group="hash", policy="pol"))
    w.submit(rec("explicit", group_id="G2", policy="other"))  # later completions don't regroup
    w.submit(rec("implicit", default_group="hash"))
    w.submit(rec(None))
    w.submit(rec(None))
    await w.close()
    got = await rows(engine, "SELECT id, group_id, policy, status FROM runs ORDER BY id")
    assert got == [("explicit", "G1", "pol", "open"), ("implicit", "hash", "p", "open")]
    assert await rows(engine, "SELECT seq FROM completions WHERE run_id IS NULL") == [(None,), (None,)]


async def test_close_drains(engine: AsyncEngine) -> None:
    w = Writer(engine, flush_interval=30.0, max_batch=64)
    await w.start()
    for i in range(300):
        w.submit(rec(f"r{i % 7}", i))
    assert w.depth == 300
    t0 = time.monotonic()
    await w.close()
    assert time.monotonic() - t0 < 10
    assert (await rows(engine, "SELECT count(*) FROM completions"))[0][0] == 300
    assert w.depth == 0
    w.submit(rec("late"))  # after close: counted, never raises
    assert w.dropped == 1
    await w.close()  # idempotent


async def test_two_writers_share_a_run(engine: AsyncEngine, migrated_url: str) -> None:
    """Two proxy processes on one database: seq comes from the run row (runs.next_seq), nothing lost."""
    other = create_engine(migrated_url)
    w1, w2 = Writer(engine, flush_interval=0), Writer(other, flush_interval=0)
    await w1.start()
    await w2.start()
    try:
        for i in range(6):
            (w1 if i % 2 == 0 else w2).submit(rec("shared", i))
            await (w1 if i % 2 == 0 else w2).flush()
    finally:
        await w1.close()
        await w2.close()
        await other.dispose()
    assert await rows(engine, "SELECT seq FROM completions ORDER BY seq") == [(i,) for i in range(6)]
    assert w1.dropped == w2.dropped == 0


async def test_unserializable_record_is_stored_as_an_error(engine: AsyncEngine) -> None:
    """A record JSON cannot hold (an object, a lone surrogate) is kept as a plain copy marked as an
    error (it used to fail its batch three times and then be dropped): nothing is lost."""
    w = Writer(engine, flush_interval=0.05)
    await w.start()
    for i in range(4):
        w.submit(rec("ok", i))
    bad = rec("ok", 99)
    bad.request = {"not json": object(), "text": "\ud800"}
    w.submit(bad)
    w.submit(rec("ok", 5))
    await w.close()
    assert w.dropped == 0
    got = await rows(engine, "SELECT seq, error FROM completions ORDER BY seq")
    assert [s for s, _ in got] == list(range(6))
    assert "stored sanitized" in got[4][1] and [e for _, e in got if e] == [got[4][1]]


async def test_a_refused_record_does_not_delay_another_tenants_batch(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22 (writer isolation): records the store refuses (a value its column cannot bind) in
    another tenant's batch: the honest run's records and reward commit without any retry backoff
    (the old writer retried the whole batch 3 times with 0.05 + 0.1 s of backoff, then split it and
    retried each bad record 3 times more: over 1 s of sleeps here), and the bad records are kept
    as error rows, not dropped."""
    backoffs: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args: object) -> object:
        # the writer's own sleeps only: asyncio.sleep is patched process-wide, and other tests'
        # servers may still be polling on their background loops
        if delay > 0 and sys._getframe(1).f_globals.get("__name__") == "rlproxy.storage.runner":
            backoffs.append(delay)
        return await real_sleep(delay, *args)

    w = Writer(engine, flush_interval=0)  # flush_interval 0: the batcher itself never sleeps
    await w.start()
    w.submit(rec("honest", 0))
    await w.flush()  # the run exists; its connection is open
    monkeypatch.setattr(asyncio, "sleep", sleep)
    for i in range(1, 7):
        w.submit(rec("honest", i))
        bad = rec(f"evil-{i}", i)
        bad.created_at = "yesterday"  # type: ignore[assignment]  # no datetime: the bind refuses it
        w.submit(bad)
    assert await w.reward("honest", 1.0, timeout=30) is True
    monkeypatch.undo()
    await w.close()
    assert backoffs == [], f"the writer backed off {backoffs} for records the store refuses"
    assert await rows(engine, "SELECT seq FROM completions WHERE run_id = 'honest' ORDER BY seq") == [
        (i,) for i in range(7)
    ]
    evil = await rows(engine, "SELECT error FROM completions WHERE run_id LIKE 'evil-%'")
    assert len(evil) == 6 and all("refused by the store" in e for (e,) in evil)
    assert w.dropped == 0


async def test_failed_writes_are_retried(migrated_url: str) -> None:
    """The database refuses writes for a while (a lock, a dropped connection): nothing is lost."""
    if migrated_url.startswith("sqlite"):
        engine = create_engine(migrated_url, busy_timeout_ms=50)
        locked = threading.Event()

        def hold_lock() -> None:
            con = sqlite3.connect(sqlite_path(migrated_url), isolation_level=None)
            con.execute("BEGIN IMMEDIATE")
            locked.set()
            time.sleep(0.8)
            con.execute("COMMIT")
            con.close()

        holder = threading.Thread(target=hold_lock)
        holder.start()
        await asyncio.to_thread(locked.wait)
        break_db = None
    else:
        engine = create_engine(migrated_url)
        holder = None

        async def break_db() -> None:  # kill every other session of this database
            async with engine.connect() as conn:
                await conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
                await conn.commit()

    w = Writer(engine, flush_interval=0.01)
    await w.start()
    try:
        if break_db is not None:
            w.submit(rec("r", 0))
            await w.flush()  # the writer holds its connection now
            await break_db()
        for i in range(20):
            w.submit(rec("r", i))
        await w.reward("r", 1.0)
        await w.close()
        assert w.write_errors >= 1 and w.dropped == 0
        n = 21 if break_db is not None else 20
        assert await rows(engine, "SELECT seq FROM completions ORDER BY seq") == [(i,) for i in range(n)]
        assert await rows(engine, "SELECT reward FROM runs") == [(1.0,)]
    finally:
        if holder is not None:
            holder.join()
        await engine.dispose()


async def test_flush_is_a_barrier(engine: AsyncEngine) -> None:
    w = Writer(engine, flush_interval=30.0)
    await w.start()
    for i in range(3):
        w.submit(rec("r", i))
    t0 = time.monotonic()
    await w.flush()
    # well under the 30 s interval: flush did not wait for it (the bound leaves room for a writer
    # process still starting on a loaded box: 6.2 s once under the full suite on 2 cores)
    assert time.monotonic() - t0 < 15 and w.depth == 0
    assert (await rows(engine, "SELECT count(*) FROM completions"))[0][0] == 3
    await w.close()
    await w.flush()  # after close: returns at once


async def test_backlog_over_max_queue_makes_room_wait(engine: AsyncEngine) -> None:
    """Backpressure: past max_queue uncommitted records, room() waits until the writer drains them."""
    w = Writer(engine, flush_interval=0.01, max_batch=4, max_queue=10)
    for i in range(9):
        w.submit(rec("r", i))
    await asyncio.wait_for(w.room(), 1)  # under the limit: no wait
    w.submit(rec("r", 9))
    with pytest.raises(TimeoutError):  # the writer is not started: nothing drains, room() waits
        await asyncio.wait_for(w.room(), 0.3)
    await w.start()
    await asyncio.wait_for(w.room(), 10)  # drained below half: requests go on
    await w.close()
    assert w.rows_written == 10 and w.dropped == 0
    assert (await rows(engine, "SELECT count(*) FROM completions"))[0][0] == 10


async def test_queue_is_capped_in_bytes_and_room_ends_in_503(engine: AsyncEngine) -> None:
    """Issue 9 case 7: the cap counts bytes (not only records), and a wait for room is bounded:
    StoreUnavailable (503 + Retry-After) instead of hanging; nothing queued is lost."""
    w = Writer(engine, flush_interval=0.01, max_queue=10_000, max_queue_bytes=4000)
    big = rec("r", 0)
    big.request = {"messages": [{"role": "user", "content": "x" * 3000}]}
    w.submit(big)
    assert w.queue_bytes > 3000 and not w.full
    w.submit(rec("r", 1))  # two records, over 4000 bytes: full although far under max_queue
    assert w.full
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:  # not started: nothing drains
        await w.room(0.3)
    assert 0.25 < time.monotonic() - t0 < 2 and info.value.retry_after >= 1
    assert w.stalled_for() > 0.25
    await w.start()
    await asyncio.wait_for(w.room(5), 10)
    await w.close()
    assert w.rows_written == 2 and w.queue_bytes == 0 and w.stalled_for() == 0


@pytest.mark.parametrize("db_kind", ["sqlite"])  # holds SQLite's write lock from another connection
async def test_reward_not_committed_in_time_is_withdrawn(migrated_url: str) -> None:
    """Issue 9 case 7: a reward the store cannot commit within its bound is a StoreUnavailable, and
    the withdrawn reward is not applied later behind the client's back."""
    engine = create_engine(migrated_url, busy_timeout_ms=50)
    w = Writer(engine, flush_interval=0)
    await w.start()
    w.submit(rec("r", 0))
    await w.flush()
    con = sqlite3.connect(sqlite_path(migrated_url), isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailable):
            await w.reward("r", 1.0, timeout=0.3)
    finally:
        con.execute("COMMIT")
        con.close()
    await w.flush()
    assert await rows(engine, "SELECT reward FROM runs") == [(None,)]
    assert await w.reward("r", 2.0, timeout=10) is True
    await w.close()
    await engine.dispose()
