"""Where the writer's batches run: the `Runner` interface, the batch loop itself (`LoopRunner`, on
the loop it is started on) and `ThreadRunner` (the same loop on a thread of its own);
`writer_process.ProcessRunner` runs it in a writer process. `storage/writer.py` keeps the invariant
(queue, bounds, journal, reward futures) and sees only `Runner`.

A runner takes operations in order (`put`, on the caller's loop), gathers them into batches (for
`flush_interval` seconds or `max_batch` operations, shorter for a reward: `LoopRunner.put`),
writes each batch in one transaction, retries it with backoff, splits one the store refuses, and
reports back with one callable: ("settle", ops, outcomes, stats), ("give_up", ops, error, keep,
stats), ("stopped", stats) or ("stats", stats) after a failed attempt; `stats` is `STATS`.

Why each mode is kept (measured, docs/performance.md):
- on the caller's loop: an in-memory SQLite database is one connection's, so one loop's; and it is
  what the writer process runs inside.
- on a thread (`writer_process=false`): the SQL on the serving loop was ~21% of its samples (py-spy,
  tagged c=1 with rewards), in bursts every request waited behind; `bench/writer_lag.py`: the
  serving thread's CPU per 1,000 records 0.95-1.52 s on the loop, 0.25-0.37 s with it on a thread.
  Against the process it used less CPU in all (0.50-0.56 vs 0.59-0.61 s per 1,000 tagged, Intel;
  no second decode, no link) at a p99 no worse.
- in a process (the default, `writer_process.py`): only a process can run at the scheduler's idle
  priority, so that a request's next process is never woken behind a batch's SQL: tagged c=1 added
  p99 1.43/1.41 ms vs 3.38/3.78 ms at the normal priority (AMD, two runs each), 3.52-3.87 vs
  5.27-9.92 ms (Intel, five pairs).

Over 400 lines on purpose: the batch loop's gathering, its wake-ups from the caller and the
retry-and-split share the inbox and its counters; the SQL of the rows themselves is in `rows.py`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rlproxy.errors import StorageError
from rlproxy.storage.db import connect_write, writer_engine
from rlproxy.storage.journal import Segment
from rlproxy.storage.records import CompletionRecord, storable
from rlproxy.storage.rows import (
    apply_reward,
    ensure_runs,
    insert_completions,
    repair_next_seq,
    stored_capture_ids,
)

log = logging.getLogger("rlproxy.storage.writer")

# Attempts at a batch before a non-transient failure makes us split it into single records.
SPLIT_AFTER = 3
MAX_BACKOFF_S = 2.0
REWARD_WAIT_S = 0.05  # a reward waits for the batch being gathered at most this long (`put`)
# A reward that finds the loop idle is committed once the last commit is this old: no more than one
# such commit per REWARD_GAP_S when clients post rewards back to back (each commit's answers let
# their clients post the next at once)
REWARD_GAP_S = 0.01
# A reward ends the batch being gathered at once when that batch is its own run's turns alone (at
# most this many: an app that waits for each answer, then posts the reward)
ALONE_MAX = 32
STATS = ("rows_written", "commits", "rewards_written", "write_errors", "replayed", "last_error")


class Item:
    """A queued completion: the record, its serialized size, its journal segment."""

    __slots__ = ("rec", "run_id", "response_id", "size", "seg", "replayed", "sanitized", "payload", "key")

    def __init__(
        self, rec: CompletionRecord, size: int, seg: Segment | None, replayed: bool, payload: bytes = b""
    ) -> None:
        # With a writer process only `payload` is sent: the record is dropped then, so its nested
        # dicts and token lists die with the request, not in a burst when the batch settles.
        self.rec: CompletionRecord | None = rec
        self.run_id = rec.run_id
        self.response_id = rec.response_id
        self.size = size
        self.seg = seg
        self.replayed = replayed  # from the journal: may be committed already (checked by capture_id)
        self.sanitized = False  # rec was replaced by records.storable() after the store refused it
        self.payload = payload  # rec as the journal encoded it (what a writer process is sent)
        self.key = 0  # a writer process settles it by this


@dataclass
class Reward:
    run_id: str
    reward: float | None  # None: the judge's reward is asked for (rows.apply_reward)
    metrics: dict[str, Any] | None
    metadata: dict[str, Any] | None
    future: asyncio.Future[bool] = field(repr=False)
    rubric: str | None = None
    split: str | None = None  # the reward body's "split" (rows.apply_reward); None keeps the run's
    key: int = 0
    # time.monotonic() past which the caller stopped waiting: not applied then (a writer process
    # knows it by this: CLOCK_MONOTONIC is the machine's)
    deadline: float | None = None
    queued: float = 0.0  # time.monotonic() when the runner queued it

    def withdrawn(self) -> bool:
        return self.future.done() or (self.deadline is not None and time.monotonic() > self.deadline)


@dataclass
class Flush:
    """A barrier: its future resolves once everything queued before it is committed."""

    future: asyncio.Future[bool] = field(repr=False)
    key: int = 0


@dataclass
class Stop:
    """The close() marker: everything queued before it is written (failures retried until
    `deadline`, time.monotonic()), then the runner ends."""

    deadline: float
    key: int = 0


Op = Item | Reward | Flush | Stop
Report = Callable[[tuple], None]


class Runner(Protocol):
    """Where a batch's SQL runs (the module doc says what each mode is for)."""

    restarts: int  # writer processes that died and were replaced
    idle_priority: bool  # the SQL runs at the scheduler's idle priority now

    async def start(self, report: Report) -> None:
        """Begin taking operations; `report` is called on the caller's loop."""

    def put(self, op: Op) -> None:
        """Queue `op` (on the caller's loop; never blocks)."""

    async def join(self) -> None:
        """After a Stop was put: return once it was reported "stopped" (or given up)."""


# The batch loop's sleep: awake, idle (any operation wakes it), or gathering a batch for
# flush_interval (an urgent operation or a full batch wakes it).
_AWAKE, _SLEEP_IDLE, _SLEEP_BATCH = 0, 1, 2


class LoopRunner:
    """The batch loop on the loop `start` is called on (an in-memory database, the writer process)."""

    restarts = 0
    idle_priority = False

    def __init__(self, engine: AsyncEngine, flush_interval: float = 0.05, max_batch: int = 256) -> None:
        self._db = engine
        self.flush_interval = flush_interval
        self.max_batch = max(1, max_batch)
        self.loop: asyncio.AbstractEventLoop | None = None  # where the SQL runs
        self.caller: asyncio.AbstractEventLoop | None = None  # where `put` is called
        self.task: asyncio.Task[None] | None = None
        self._report: Report = lambda msg: None
        self._close_deadline: float | None = None
        self._conn: AsyncConnection | None = None
        self.rows_written = self.commits = self.rewards_written = self.write_errors = self.replayed = 0
        self.last_error: str | None = None  # of the last failed transaction, cleared by a commit
        # The queue: a deque the caller appends to and the loop pops from (both atomic under the
        # GIL), so a put costs no system call; the loop is woken (one call_soon_threadsafe) only
        # while it sleeps: idle (`_SLEEP_IDLE`: by anything) or gathering a batch (`_SLEEP_BATCH`:
        # by an urgent operation or a full batch).
        self._inbox: collections.deque[Op] = collections.deque()
        self._wake = asyncio.Event()
        self._sleep = _AWAKE
        self._urgent_in = 0  # flushes and stops queued (counted by the caller)...
        self._urgent_out = 0  # ...and taken (counted by the loop): flush without waiting for more
        self._soon_in = 0  # rewards queued...
        self._soon_out = 0  # ...and taken: gather for at most REWARD_WAIT_S while one waits
        self._written_at = 0.0  # time.monotonic() when the loop last committed a batch

    async def start(self, report: Report) -> None:
        self.loop = self.caller = asyncio.get_running_loop()
        self._report = report
        self.task = asyncio.create_task(self._run(), name="rlproxy-writer")

    async def join(self) -> None:
        try:
            await self.task
        finally:
            await self.discard_conn()

    def stats(self) -> tuple:
        """The counters, in the order `STATS` names them."""
        return tuple(getattr(self, name) for name in STATS)

    def put(self, op: Op) -> None:
        """A completion wakes an idle loop or fills a batch. A reward does not cut the batch short:
        it is committed with the batch being gathered, within `flush_interval` or REWARD_WAIT_S,
        whichever is shorter (a commit of its own per reward was most of the writer's time under
        tagged traffic with rewards flowing: issue 24); one that finds the loop idle is committed at
        once, or REWARD_GAP_S after the last commit when rewards come back to back (`_next_batch`),
        and one whose batch holds only its own run's turns ends it at once (`_alone`): nothing else
        is coming to share either. A flush or a stop ends the batch at once."""
        sleep = self._sleep
        if isinstance(op, Item):
            self._inbox.append(op)
            wake = sleep == _SLEEP_IDLE or (sleep == _SLEEP_BATCH and len(self._inbox) >= self.max_batch)
        elif isinstance(op, Reward):
            first = self._soon_in == self._soon_out
            self._soon_in += 1
            op.queued = time.monotonic()
            self._inbox.append(op)
            wake = sleep == _SLEEP_IDLE or (sleep == _SLEEP_BATCH and self._alone())
            if not wake and sleep == _SLEEP_BATCH and first and self.flush_interval > REWARD_WAIT_S:
                self._to_loop(self._wake_soon)
        else:
            if isinstance(op, Stop):
                self._close_deadline = op.deadline
            self._urgent_in += 1
            self._inbox.append(op)
            wake = sleep != _AWAKE
        if wake:
            self._sleep = _AWAKE
            self._to_loop(self._wake.set)

    def _to_loop(self, fn: Callable[[], Any]) -> None:
        if self.loop is None or self.loop is self.caller:
            fn()
        else:
            self.loop.call_soon_threadsafe(fn)

    def _alone(self) -> bool:
        """Whether the batch being gathered is one run's turns and its reward alone (at most
        ALONE_MAX operations). `tuple()` copies the queue in one step under the interpreter lock
        (the loop's thread may be taking from it)."""
        if len(self._inbox) > ALONE_MAX:
            return False
        runs = set()
        reward = False
        for o in tuple(self._inbox):
            if isinstance(o, Reward):
                reward = True
            elif not isinstance(o, Item):
                return False
            runs.add(o.run_id)
        return reward and len(runs) == 1

    def _wake_soon(self) -> None:
        """On the loop: end the batch being gathered within REWARD_WAIT_S."""
        self.loop.call_later(REWARD_WAIT_S, self._wake.set)

    async def _run(self) -> None:
        """Batches, each written (retried, split) before the next is taken, until a Stop."""
        while True:
            batch = await self._next_batch()
            stop = isinstance(batch[-1], Stop)
            if stop:
                batch.pop()
            if batch:
                try:
                    await self._write_with_retry(batch)
                except Exception:  # the writer must outlive any bug in a batch
                    log.exception("writer: unexpected failure; %d operations given up", len(batch))
                    self._report(("give_up", batch, StorageError("the writer failed"), True, self.stats()))
            if stop:
                self._report(("stopped", self.stats()))
                return

    async def _next_batch(self) -> list[Op]:
        """Wait for work, gather records for up to `flush_interval` unless an urgent operation
        (flush, stop) is queued, then take up to `max_batch` operations in queue order (a stop ends
        the batch). A reward first in the queue that came after the last batch was committed found
        the writer idle: everything before it is committed and nothing is coming to share its
        transaction, so it is committed once the last commit is REWARD_GAP_S old, at once after a
        pause (a reward posted a while after its run's last turn, as an app scoring an episode
        does, waited REWARD_WAIT_S for nothing)."""
        while not self._inbox:
            await self._sleep_until(_SLEEP_IDLE, None)
        head = self._inbox[0]
        if (
            self._urgent_in == self._urgent_out
            and len(self._inbox) < self.max_batch
            and self.flush_interval > 0
        ):
            window = self.flush_interval
            if self._soon_in != self._soon_out:  # a reward is waiting: not longer than REWARD_WAIT_S
                window = min(window, REWARD_WAIT_S)
            if isinstance(head, Reward) and head.queued >= self._written_at:  # it found us idle
                window = min(window, self._written_at + REWARD_GAP_S - time.monotonic())
            elif self._alone():  # one run's turns and its reward: nothing else is coming
                window = 0
            if window > 0:
                await self._sleep_until(_SLEEP_BATCH, window)
        batch: list[Op] = []
        while self._inbox and len(batch) < self.max_batch:
            op = self._inbox.popleft()
            batch.append(op)
            if isinstance(op, Flush | Stop):
                self._urgent_out += 1
                if isinstance(op, Stop):
                    break
            elif isinstance(op, Reward):
                self._soon_out += 1
        return batch

    async def _sleep_until(self, mode: int, timeout: float | None) -> None:
        self._wake.clear()
        self._sleep = mode  # after the clear: a wake-up from now on is kept
        if (mode == _SLEEP_IDLE and self._inbox) or (
            mode == _SLEEP_BATCH and self._urgent_in != self._urgent_out
        ):  # arrived between the check and the flag
            self._sleep = _AWAKE
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass
        self._sleep = _AWAKE

    async def _write_with_retry(self, batch: list[Op]) -> None:
        attempt = 0
        while True:
            try:
                results = await self._write(batch)
            except Exception as e:
                attempt += 1
                self.write_errors += 1
                self.last_error = f"{type(e).__name__}: {e}"[:500]
                self._report(("stats", self.stats()))
                if not _is_permanent(e):  # refused values leave the connection usable (rolled back)
                    await self.discard_conn()
                repaired = False
                if _seq_taken(e):  # rows written around runs.next_seq (a script): count on past them
                    repaired = await self._repair(batch)
                transient = _is_transient(e)
                if not transient and not repaired and len(batch) > 1:
                    # A record (or reward) the database refuses: split at once, without backoff,
                    # so the other operations of the batch (other tenants') commit without it.
                    log.warning(
                        "writer: a batch of %d operations was refused (%s); splitting it", len(batch), e
                    )
                    mid = len(batch) // 2
                    await self._write_with_retry(batch[:mid])
                    await self._write_with_retry(batch[mid:])
                    return
                log.warning(
                    "writer: transaction of %d operations failed (attempt %d, %s): %s",
                    len(batch),
                    attempt,
                    "will retry" if transient else "permanent?",
                    e,
                )
                if len(batch) == 1 and _is_permanent(e):
                    op = batch[0]
                    if isinstance(op, Item) and not op.sanitized:  # keep it, as an error row
                        op.rec, op.sanitized = storable(op.rec, f"refused by the store: {e}"[:500]), True
                        continue
                    attempt = max(attempt, SPLIT_AFTER)  # retrying cannot change the answer
                if not transient and attempt >= SPLIT_AFTER:
                    if len(batch) > 1:
                        for op in batch:
                            await self._write_with_retry([op])
                        return
                    self._report(("give_up", batch, e, False, self.stats()))
                    return
                if self._close_deadline is not None and time.monotonic() > self._close_deadline:
                    self._report(("give_up", batch, e, True, self.stats()))
                    return
                await asyncio.sleep(min(0.05 * 2 ** (attempt - 1), MAX_BACKOFF_S))
                continue
            self._written_at = time.monotonic()  # before the caller hears of it
            self.last_error = None
            self._report(("settle", batch, results, self.stats()))
            return

    async def _repair(self, batch: list[Op]) -> bool:
        """Move the counters of the batch's runs past their stored completions (own transaction);
        True when done (the batch is then worth retrying whole)."""
        run_ids = [op.run_id for op in batch if isinstance(op, Item) and op.run_id is not None]
        try:
            conn = await connect_write(self._db)
            try:
                async with conn.begin():
                    await repair_next_seq(conn, run_ids)
            finally:
                await conn.close()
            log.warning("writer: seq counters of %d run(s) moved past rows written around them", len(run_ids))
            return True
        except Exception as e:  # the retry fails again and says why
            log.warning("writer: could not repair seq counters: %s", e)
            return False

    async def discard_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await conn.invalidate()
            await conn.close()
        except Exception as e:
            log.debug("writer: closing a broken connection: %s", e)

    async def _write(self, batch: list[Op]) -> list[Any]:
        """One transaction for the batch, in queue order: each stretch of records is inserted, then
        the reward after it applied (so a reward sees its run's earlier completions). Returns one
        outcome per op (a bool or an exception for a reward, else None)."""
        items = [op for op in batch if isinstance(op, Item)]
        if not items and not any(isinstance(op, Reward) for op in batch):
            return [None] * len(batch)  # barriers only: everything before them is committed already
        if self._conn is None:
            self._conn = await connect_write(self._db)
        conn = self._conn
        outcomes: list[Any] = []
        written = replayed_n = 0
        async with conn.begin():
            replayed = [it.rec.capture_id for it in items if it.replayed and it.rec.capture_id]
            have: set[str] = set()
            if replayed:  # a journal record that was committed before the crash is stored once
                have = await stored_capture_ids(conn, replayed)
            now = datetime.now(UTC)
            stretch: list[CompletionRecord] = []
            for op in batch:
                if isinstance(op, Item):
                    if not (op.replayed and op.rec.capture_id in have):
                        stretch.append(op.rec)
                        replayed_n += op.replayed
                    outcomes.append(None)
                    continue
                if stretch:
                    written += await _insert(conn, stretch, now)
                    stretch = []
                if isinstance(op, Reward) and not op.withdrawn():  # the caller timed out
                    outcomes.append(
                        await apply_reward(
                            conn, op.run_id, op.reward, op.metrics, op.metadata, now, op.rubric, op.split
                        )
                    )
                else:
                    outcomes.append(None)
            if stretch:
                written += await _insert(conn, stretch, now)
        self.rows_written += written
        self.commits += 1
        self.replayed += replayed_n
        self.rewards_written += sum(1 for o in outcomes if o is True)
        return outcomes


class ThreadRunner(LoopRunner):
    """The batch loop on a thread of its own, with its own event loop and its own engine
    (`db.writer_engine`: connections belong to the loop that opened them; SQLite through plain
    `sqlite3`, `inline.py`). The caller's loop only queues, and settles what the thread reports
    (`call_soon_threadsafe`), so every counter, journal segment and reward future is still touched
    there alone. What it cannot remove is the GIL: the thread's Python can delay the serving loop
    by up to the interpreter's switch interval while both want to run."""

    async def start(self, report: Report) -> None:
        caller, loop = asyncio.get_running_loop(), asyncio.new_event_loop()
        self._thread = threading.Thread(target=_serve, args=(loop,), name="rlproxy-writer", daemon=True)
        self._thread.start()
        self._db = writer_engine(self._db)
        await _on(loop, super().start(lambda msg: caller.call_soon_threadsafe(report, msg)))
        self.caller = caller

    async def join(self) -> None:
        try:
            await _on(self.loop, self._join())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            await asyncio.to_thread(self._thread.join, 10.0)

    async def _join(self) -> None:
        try:
            await super().join()
        finally:
            await self._db.dispose()


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        loop.close()


def _on(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Future[Any]:
    """`coro` run on `loop` (another thread's), awaitable here."""
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


async def _insert(conn: AsyncConnection, records: list[CompletionRecord], now: datetime) -> int:
    first_seq = await ensure_runs(conn, records)  # locks the runs' rows until the commit
    return await insert_completions(conn, records, first_seq, now)


# PostgreSQL's SQLSTATEs of a transaction another one got in the way of: retrying it succeeds.
_RETRY_SQLSTATES = {"40001", "40P01", "55P03"}  # serialization failure, deadlock, lock not available


def _seq_taken(e: BaseException) -> bool:
    """The unique (run_id, seq) constraint refused a number runs.next_seq handed out."""
    text = str(e)  # PostgreSQL names the constraint, SQLite its columns
    return isinstance(e, exc.IntegrityError) and (
        "uq_completions_run_seq" in text or "completions.run_id, completions.seq" in text
    )


def _is_permanent(e: BaseException) -> bool:
    """Errors about the values themselves (a bind, a constraint, a type): the same again fails again."""
    if isinstance(e, exc.IntegrityError | exc.DataError) and not _seq_taken(e):
        return True
    values = TypeError | ValueError | OverflowError | UnicodeError
    if isinstance(e, exc.StatementError) and not isinstance(e, exc.DBAPIError):
        return isinstance(e.orig, values)
    if isinstance(e, exc.DBAPIError) and not e.connection_invalidated:
        # asyncpg: "invalid input for query argument" (its DataError, a ValueError) under the adapter's
        cause: BaseException | None = e.orig
        for _ in range(4):
            if cause is None:
                break
            if isinstance(cause, values):
                return True
            cause = cause.__cause__ or cause.__context__
        return False
    return isinstance(e, values)


def _is_transient(e: BaseException) -> bool:
    """Errors that waiting can fix: locks, lost connections, a database restarting."""
    if isinstance(e, exc.DBAPIError):
        if e.connection_invalidated:
            return True
        if getattr(e.orig, "sqlstate", None) in _RETRY_SQLSTATES:
            return True
        return isinstance(e, exc.OperationalError | exc.InterfaceError)
    return isinstance(e, OSError | ConnectionError | TimeoutError | exc.DisconnectionError)
