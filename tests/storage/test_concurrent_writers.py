"""Several writers on one database (proxy replicas on one PostgreSQL; SQLite too): seq, rewards.

Each writer has its own engine, so its transactions run on their own connections, concurrently with
the other's, as two `serve` processes' would (tests/proxy/test_replicas.py runs real processes).
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from test_writer import rec, rows

from rlproxy.storage.db import create_engine
from rlproxy.storage.errors import RewardConflict
from rlproxy.storage.leader import LeaderLock, lock_key
from rlproxy.storage.writer import Writer


async def _writers(
    engine: AsyncEngine, url: str, n: int, **kw: object
) -> tuple[list[Writer], list[AsyncEngine]]:
    engines = [engine, *(create_engine(url) for _ in range(n - 1))]
    writers = [Writer(e, **kw) for e in engines]  # type: ignore[arg-type]
    for w in writers:
        await w.start()
    return writers, engines[1:]


async def test_seq_gapless_with_concurrent_writers(engine: AsyncEngine, migrated_url: str) -> None:
    """3 writers, 30 runs x 8 completions, each run's completions spread over every writer at random
    and submitted at once: every run holds seq 0..7 exactly once, nothing dropped or retried away."""
    writers, extra = await _writers(engine, migrated_url, 3, flush_interval=0.005, max_batch=16)
    try:

        async def run(r: int) -> None:
            for i in range(8):
                await asyncio.sleep(random.random() * 0.01)
                random.choice(writers).submit(rec(f"run-{r}", i))

        await asyncio.gather(*(run(r) for r in range(30)))
        await asyncio.gather(*(w.flush() for w in writers))
    finally:
        for w in writers:
            await w.close()
        for e in extra:
            await e.dispose()
    assert sum(w.rows_written for w in writers) == 240
    assert sum(w.dropped for w in writers) == 0
    by_run: dict[str, list[int]] = defaultdict(list)
    for run_id, seq in await rows(engine, "SELECT run_id, seq FROM completions ORDER BY run_id, seq"):
        by_run[run_id].append(seq)
    assert len(by_run) == 30
    assert all(seqs == list(range(8)) for seqs in by_run.values()), dict(by_run)
    counters = dict(await rows(engine, "SELECT id, next_seq FROM runs"))
    assert set(counters.values()) == {8}


async def test_racing_rewards_one_wins(engine: AsyncEngine, migrated_url: str) -> None:
    """Two different rewards for one run on two writers at the same moment, 50 times: exactly one is
    stored (True) and the other is a RewardConflict, every time; the stored one is the winner's."""
    writers, extra = await _writers(engine, migrated_url, 2, flush_interval=0)
    try:
        for i in range(50):
            run = f"r{i}"
            writers[i % 2].submit(rec(run, 0))
            await writers[i % 2].flush()
            outcomes = await asyncio.gather(
                writers[0].reward(run, 1.0), writers[1].reward(run, 2.0), return_exceptions=True
            )
            won = [o for o in outcomes if o is True]
            lost = [o for o in outcomes if isinstance(o, RewardConflict)]
            assert len(won) == 1 and len(lost) == 1, (i, outcomes)
            stored = (await rows(engine, "SELECT reward FROM runs WHERE id = :r", r=run))[0][0]
            assert stored == (1.0 if outcomes[0] is True else 2.0)
    finally:
        for w in writers:
            await w.close()
        for e in extra:
            await e.dispose()


async def test_same_reward_twice_on_two_writers(engine: AsyncEngine, migrated_url: str) -> None:
    """The same reward posted to two replicas (a client retry that crossed): one stores, one is a no-op."""
    writers, extra = await _writers(engine, migrated_url, 2, flush_interval=0)
    try:
        writers[0].submit(rec("same", 0))
        await writers[0].flush()
        outcomes = await asyncio.gather(writers[0].reward("same", 0.5), writers[1].reward("same", 0.5))
    finally:
        for w in writers:
            await w.close()
        for e in extra:
            await e.dispose()
    assert sorted(outcomes) == [False, True]


async def test_counter_repaired_after_rows_written_around_it(engine: AsyncEngine) -> None:
    """A script inserted completions without moving runs.next_seq: the writer's numbers collide with
    the unique (run_id, seq) constraint once, it moves the counter past them, nothing is dropped."""
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO runs (id, status, created_at) VALUES ('s', 'open', CURRENT_TIMESTAMP)")
        )
        for seq in (0, 1):
            await conn.execute(
                text("INSERT INTO completions (run_id, seq, created_at) VALUES ('s', :s, CURRENT_TIMESTAMP)"),
                {"s": seq},
            )
    w = Writer(engine, flush_interval=0)
    await w.start()
    try:
        w.submit(rec("s", 2))
        w.submit(rec("s", 3))
        await w.flush()
    finally:
        await w.close()
    assert w.dropped == 0 and w.write_errors >= 1
    assert await rows(engine, "SELECT seq FROM completions WHERE run_id = 's' ORDER BY seq") == [
        (0,),
        (1,),
        (2,),
        (3,),
    ]
    assert await rows(engine, "SELECT next_seq FROM runs WHERE id = 's'") == [(4,)]


async def test_leader_lock_one_holder(migrated_url: str) -> None:
    """One holder per store (advisory lock on PostgreSQL, file lock on SQLite); freed on release."""
    first, second = LeaderLock(migrated_url, retry=0.05), LeaderLock(migrated_url, retry=0.05)
    try:
        assert await first.try_acquire()
        assert not await second.try_acquire()
        assert await first.still_held()
        waiting = asyncio.create_task(second.acquire())  # stands by
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await first.release()
        await asyncio.wait_for(waiting, 5)  # takes over
        assert second.held and not await first.try_acquire()
    finally:
        await first.release()
        await second.release()


async def test_leader_lock_lost_with_its_connection(pg_migrated_url: str) -> None:
    """PostgreSQL: the leader's session ends (its process died, or the server cut it): the lock is free
    for a standby at once, and the old holder finds out before its next step (still_held)."""
    first, second = LeaderLock(pg_migrated_url), LeaderLock(pg_migrated_url)
    try:
        assert await first.try_acquire() and not await second.try_acquire()
        engine = create_engine(pg_migrated_url)
        try:
            async with engine.begin() as conn:
                await conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_locks "
                        "WHERE locktype = 'advisory' AND objid = (:k & 4294967295) AND granted"
                    ),
                    {"k": lock_key("trainer")},
                )
        finally:
            await engine.dispose()
        for _ in range(50):
            if await second.try_acquire():
                break
            await asyncio.sleep(0.05)
        assert second.held
        assert not await first.still_held()
    finally:
        await first.release()
        await second.release()
