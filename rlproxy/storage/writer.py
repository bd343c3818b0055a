"""The single writer: every captured completion and every reward reaches SQL through here.

(Over 400 lines on purpose: the queue, its backpressure and the retry/split loop share one piece of
state, the pending operations, and splitting them would spread one invariant over several files;
the SQL of the rows themselves lives in `rows.py`.)

Why one writer: SQLite allows one writing transaction at a time, and `seq` (0,1,2,... per run)
must be gapless. A FIFO queue feeding one connection gives both without locks: the writer task
takes what has queued up (for `flush_interval` seconds or `max_batch` operations), writes it in one
transaction (`BEGIN IMMEDIATE` on SQLite), and only then moves on. A reward travels through the same
queue, so by the time it is applied every completion submitted before it for its run is committed
in the same or an earlier transaction; the caller awaits a future resolved after the commit. A
reward does not cut the batch short: it is committed with the batch being gathered, within
`flush_interval` or REWARD_WAIT_S, whichever is shorter (a commit of its own per reward was most
of the writer's time under tagged traffic with rewards flowing: issue 24); one that finds the writer
idle (no batch being gathered) is committed at once, or REWARD_GAP_S after the last commit when
rewards come back to back, and one whose batch holds only its own run's turns ends it at once.

Several processes (replicas on one PostgreSQL) each run one writer. What keeps them correct is in
the transaction, not in memory: `seq` comes from the run row's counter (`rows.ensure_runs`, which
locks the batch's run rows in id order until the commit), a reward reads its run row FOR NO KEY
UPDATE (`rows.apply_reward`: two different rewards racing on two replicas give one 200, one 409),
and a deadlock or serialization failure is retried like a lost connection. What one process
cannot see is another's queue: a reward for a run the store does not know yet is looked up again
for PEER_GRACE_S before its 404, and a reward posted to replica B may commit up to `flush_interval`
before the last completion the client got from replica A (README, "Several proxies").

Capture never breaks the user's response: `submit` never blocks or raises; a failed transaction is
logged, counted and retried with backoff (a locked or unreachable database heals by itself); a
batch that keeps failing for a reason that retrying cannot fix is split, and only a single record
that cannot be stored on its own is dropped (logged with its run id, counted in `dropped`).

Bounded: past `max_queue` operations or `max_queue_bytes` bytes of uncommitted records (each one's
serialized size: request, response, tokens) `room(timeout)` waits until the backlog is half drained
and raises `StoreUnavailable` (HTTP 503, retryable) when `timeout` passes first; nothing queued is
given up. `stalled_for()` says how long work has waited without a commit (the health check).

What a crash can lose: nothing the client received in full. `submit` appends the record to the
crash journal (`journal.py`, one `os.write`) before it is queued, and callers submit before the
response's last byte is sent; `recover()` stores the journal's records on the next start, once
each (`completions.capture_id` is unique). An OS crash or power cut can lose what the kernel had
not yet written to disk: the journal's last seconds, and with SQLite's synchronous=NORMAL the last
commits. A reward is acknowledged (HTTP 200) only after it and its run's completions are committed.

Off the event loop: the SQL runs on the writer's own thread, with its own event loop and its own
engine (`db.clone_engine`: connections belong to the loop that opened them). Building statements,
serializing rows, SQLAlchemy's result handling and the commits took ~5 ms of Python per batch on
the serving loop (profiled: docs/performance.md), which every request then waited behind; now the
loop only journals and enqueues (`submit`), and settles what the thread reports back (counters,
journal segments, reward futures), so all bookkeeping stays on the caller's loop and the thread
touches only the connection. An in-memory SQLite database (one connection's, so one loop's) is
written on the caller's loop as before (`thread=False`).

In a process of its own (`process=True`, what `serve` uses): the same `_run` loop runs in a writer
process (`writer_process.py`), fed over a socket (`writer_link.py`, which says why: the thread's
SQL held the serving process's interpreter lock). The caller's side is unchanged, its queue
becomes the operations sent and not settled (`_ops`), and a writer process that dies is replaced
and sent them all again.

The SQL of a transaction (new runs, completions and their `seq`, rewards) is in `rows.py`. This
file stays over 400 lines because the queue, its bounds, the retry-and-split and the journal
bookkeeping all act on the same queue and counters: apart, they would share private state.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rlproxy.errors import StorageError
from rlproxy.storage.db import connect_write, engine_recipe, is_sqlite, sqlite_path, writer_engine
from rlproxy.storage.errors import RunNotFound, StoreUnavailable
from rlproxy.storage.journal import Journal, Segment, encode
from rlproxy.storage.records import CompletionRecord, storable
from rlproxy.storage.rows import (
    apply_reward,
    ensure_runs,
    insert_completions,
    repair_next_seq,
    stored_capture_ids,
)
from rlproxy.storage.writer_link import WriterProcess, decode_outcome, load_error

log = logging.getLogger(__name__)

# Attempts at a batch before a non-transient failure makes us split it into single records.
SPLIT_AFTER = 3
MAX_BACKOFF_S = 2.0
# A reward for a run the database does not know yet, on a store several replicas write (PostgreSQL):
# looked up again every PEER_RETRY_S for PEER_GRACE_S before the 404, since the replica that served
# the run's first completion commits it up to its flush_interval (0.05 s) + a transaction later.
PEER_GRACE_S = 1.0
PEER_RETRY_S = 0.05
REWARD_WAIT_S = 0.05  # a reward waits for the batch being gathered at most this long (module doc)
# A reward that finds the writer idle is committed once the last commit is this old (module doc):
# at once after a pause, and no more than one such commit per REWARD_GAP_S when clients post rewards
# back to back (each commit's answers let their clients post the next at once)
REWARD_GAP_S = 0.01
# A reward ends the batch being gathered at once when that batch is its own run's turns alone (at
# most this many): nothing else is coming to share the transaction (an app that waits for each
# answer, then posts the reward). With another run's operation in it, it waits (module doc).
ALONE_MAX = 32
# A writer process at idle priority (`idle_priority`) goes to the normal priority once it starves:
# runnable but not running for STARVED_SHARE of the last STARVED_SPAN_S, with operations waiting at
# every look (one each STARVE_CHECK_S). The kernel counts a wait when it ends, so a starved
# process's count moves in bursts: the span is several looks long. Under bench/proxy.py's loads it
# waits 10-30% of the time; under a busy loop on every core, most of it. Slow SQL (a locked store)
# is not runnable time: its busy handler sleeps. It is put back at idle priority IDLE_AGAIN_S later
# (doubled, up to IDLE_AGAIN_MAX_S, each time it starves again within IDLE_AGAIN_MAX_S of that).
STARVE_CHECK_S = 0.5
STARVED_SPAN_S = 2.0
STARVED_SHARE = 0.5
IDLE_AGAIN_S = 60.0
IDLE_AGAIN_MAX_S = 3600.0


class _Item:
    """A queued completion: the record, its serialized size, its journal segment."""

    __slots__ = ("rec", "run_id", "response_id", "size", "seg", "replayed", "sanitized", "payload", "key")

    def __init__(
        self, rec: CompletionRecord, size: int, seg: Segment | None, replayed: bool, payload: bytes = b""
    ) -> None:
        # With a writer process only `payload` is sent: `_send` then drops the record, so its
        # nested dicts and token lists die with the request, not in a burst when the batch settles.
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
class _Reward:
    run_id: str
    reward: float | None  # None: the judge's reward is asked for (rows.apply_reward)
    metrics: dict[str, Any] | None
    metadata: dict[str, Any] | None
    future: asyncio.Future[bool] = field(repr=False)
    rubric: str | None = None
    split: str | None = None  # the reward body's "split" (rows.apply_reward); None keeps the run's
    key: int = 0
    # time.monotonic() past which the caller stopped waiting: not applied then (a writer process
    # knows it without the withdrawal message, which can arrive after its next attempt began)
    deadline: float | None = None
    queued: float = 0.0  # time.monotonic() when the writer queued it (`_next_batch`)

    def withdrawn(self) -> bool:
        return self.future.done() or (self.deadline is not None and time.monotonic() > self.deadline)


@dataclass
class _Flush:
    """A barrier: its future resolves once everything queued before it is committed."""

    future: asyncio.Future[bool] = field(repr=False)
    key: int = 0


class _Stop:
    """The close() marker: everything queued before it is written, then the task ends."""

    key = 0


_Op = _Item | _Reward | _Flush | _Stop

# The writer's sleep (Writer._sleep): awake, idle (any operation wakes it), or gathering a batch for
# flush_interval (an urgent operation or a full batch wakes it).
_AWAKE, _SLEEP_IDLE, _SLEEP_BATCH = 0, 1, 2


class Writer:
    """Batches completions and rewards into transactions on one connection (see module doc)."""

    def __init__(
        self,
        engine: AsyncEngine,
        flush_interval: float = 0.05,
        max_batch: int = 256,
        drain_timeout: float = 30.0,
        max_queue: int = 10_000,
        max_queue_bytes: int = 256 << 20,
        journal: Journal | None = None,
        thread: bool | None = None,
        process: bool = False,
        idle_priority: bool = False,
    ) -> None:
        self._engine = engine  # the caller's; SQL goes through self._db (the thread's clone)
        self._db = engine
        # process=True: the SQL runs in a writer process (storage/writer_link.py) when the engine
        # can be made again there (a database file or server, no options that cannot travel)
        recipe = engine_recipe(engine) if process and not _in_memory(engine) else None
        self._recipe = recipe and {
            **recipe,
            "flush_interval": flush_interval,
            "max_batch": max_batch,
            # writer_process.py: SCHED_IDLE, where the starvation watch can see the scheduler
            "idle_priority": idle_priority and WriterProcess.can_watch(),
        }
        self._child: WriterProcess | None = None
        self._spawned = 0  # writer processes started: from the second on, ops are sent "again"
        self._idle_wanted = self.idle_priority  # the setting; `idle_priority` is the process's now
        self._watch: asyncio.TimerHandle | None = None  # `_watch_priority`, while idle is wanted
        # (when, its run-queue seconds) at the looks since operations last found none waiting
        self._waited: collections.deque[tuple[float, float]] = collections.deque()
        self._demoting = False  # the writer process is being replaced at normal priority
        self.idle_again_s = IDLE_AGAIN_S  # after its first starvation: back at idle priority this late
        self._idle_after = 0.0  # ...and after the last one (doubled while it keeps starving)
        self._idle_at: float | None = None  # when the normal priority ends (None: at idle priority)
        self._idle_since = time.monotonic()  # when it last went (or started) at idle priority
        # a completion is sent within this (it is journaled): shorter than a batch's gathering
        self._item_wait = min(flush_interval, REWARD_WAIT_S) / 2
        self._ops: dict[int, _Op] = {}  # sent to the writer process, not settled yet (by key)
        self._next_key = 0
        self._base = (0, 0, 0, 0, 0)  # counters of the writer processes before the current one
        self._deaths = 0  # writer processes lost in a row (the restart's backoff)
        self._respawn: asyncio.Task[None] | None = None
        # None: a thread of its own unless the database is in-memory SQLite (one loop's connection)
        if self._recipe is not None:
            self._threaded = False
        else:
            self._threaded = thread if thread is not None else not _in_memory(engine)
        self._loop: asyncio.AbstractEventLoop | None = None  # the caller's loop (bookkeeping)
        self._wloop: asyncio.AbstractEventLoop | None = None  # the writer's loop (SQL)
        self._thread: threading.Thread | None = None
        # Backpressure: past `max_queue` uncommitted operations or `max_queue_bytes` bytes `room()`
        # waits until the backlog is half drained, so a sustained overload slows requests to the
        # database's pace instead of growing memory (and full garbage collections over the queued
        # records) without bound.
        self.max_queue = max(1, max_queue)
        self.max_queue_bytes = max(1, max_queue_bytes)
        self.journal = journal
        self._bytes = 0
        self._progress_at = time.monotonic()  # last commit, or when the queue last became non-empty
        self.last_error: str | None = None  # of the last failed transaction, cleared by a commit
        self._room = asyncio.Event()
        self._room.set()
        self.flush_interval = flush_interval
        self.max_batch = max(1, max_batch)
        self.drain_timeout = drain_timeout  # close(): how long to keep retrying a failing database
        # The queue: a deque the caller appends to and the writer pops from (both atomic under the
        # GIL), so a submit costs no system call; the writer is woken (one call_soon_threadsafe)
        # only while it sleeps: idle (`_SLEEP_IDLE`: by anything) or gathering a batch
        # (`_SLEEP_BATCH`: by an urgent operation or a full batch).
        self._inbox: collections.deque[_Op] = collections.deque()
        self._wake = asyncio.Event()  # the writer loop's
        self._sleep = _AWAKE
        self._urgent_in = 0  # flushes and stops queued (counted by the caller)...
        self._urgent_out = 0  # ...and taken (counted by the writer): flush without waiting for more
        self._soon_in = 0  # rewards queued...
        self._soon_out = 0  # ...and taken: gather for at most REWARD_WAIT_S while one waits
        self._written_at = 0.0  # time.monotonic() when the writer last committed a batch
        self._conn: AsyncConnection | None = None
        self._task: asyncio.Future[None] | None = None  # the writer task (or its thread) ends
        self._closing = False
        self._closed = False
        self._close_deadline: float | None = None
        self._pending = 0
        # Responses ids of queued records (id -> how many): `may_hold` says whether a read that missed
        # the store should flush the queue and look again
        self._responses: dict[str, int] = {}
        self.rows_written = 0  # completions committed
        self.commits = 0  # transactions committed
        self.rewards_written = 0
        self.write_errors = 0  # failed transaction attempts (each one retried)
        self.dropped = 0  # records given up on (logged); 0 unless a record cannot be stored at all
        self.replayed = 0  # journal records stored on start (committed before the crash or not)
        self.restarts = 0  # writer processes that died and were replaced (process=True)

    # -- public API ---------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Operations submitted and not yet committed (or dropped)."""
        return self._pending

    @property
    def queue_bytes(self) -> int:
        """Serialized bytes of the completions submitted and not yet committed (or dropped)."""
        return self._bytes

    @property
    def full(self) -> bool:
        """True while new requests must wait for `room()` (the hot path's cheap check)."""
        return not self._room.is_set()

    @property
    def idle_priority(self) -> bool:
        """True while the writer process runs (or is to run) at the scheduler's idle priority."""
        return bool(self._recipe and self._recipe["idle_priority"])

    def stalled_for(self) -> float:
        """Seconds work has been waiting without a commit (0 when the queue is empty)."""
        if self._pending == 0:
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    async def start(self) -> None:
        """Start the writer task, on its own thread unless in-memory (idempotent)."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self._recipe is not None:
            self._task = self._loop.create_future()  # resolved by the process's "stopped"
            await self._spawn()
            return
        if not self._threaded:
            self._wloop = self._loop
            self._task = asyncio.create_task(self._run(), name="rlproxy-writer")
            return
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(ready, done), name="rlproxy-writer", daemon=True
        )
        self._thread.start()
        await asyncio.wrap_future(ready)
        self._task = asyncio.wrap_future(done)

    def _thread_main(
        self, ready: concurrent.futures.Future[None], done: concurrent.futures.Future[None]
    ) -> None:
        """The writer thread: its own loop, its own engine, the `_run` loop until the stop marker."""
        loop = asyncio.new_event_loop()

        async def main() -> None:
            self._wloop = loop
            self._db = writer_engine(self._engine)
            ready.set_result(None)
            try:
                await self._run()
            finally:
                await self._discard_conn()
                await self._db.dispose()

        try:
            loop.run_until_complete(main())
            done.set_result(None)
        except BaseException as e:  # the caller's close() re-raises it
            if not ready.done():
                ready.set_exception(e)
            done.set_exception(e)
        finally:
            loop.close()

    def _to_writer(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the writer's loop (in order with every other call)."""
        if self._wloop is None or self._wloop is self._loop:
            fn(*args)
        else:
            self._wloop.call_soon_threadsafe(fn, *args)

    def _to_caller(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the caller's loop (the bookkeeping's), from the writer."""
        if self._loop is None or self._wloop is self._loop:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    async def recover(self, timeout: float | None = None) -> int:
        """Queue the journal's records left by a dead process, then wait (up to `timeout` seconds)
        until they are committed. Records already in the store are skipped. Returns how many."""
        if self.journal is None:
            return 0
        found = await asyncio.to_thread(self.journal.recover)
        n = 0
        for seg, records in found:
            for rec in records:
                self._enqueue(_Item(rec, 0, seg, True))
                n += 1
        if n:
            log.info("journal: replaying %d records of a previous run", n)
            try:
                await asyncio.wait_for(self.flush(), timeout)
            except TimeoutError:
                log.warning("journal: the store is slow; %d replayed records still queued", self._pending)
        return n

    def submit(self, rec: CompletionRecord) -> None:
        """Journal a completion, then queue it for storage. Never blocks, never raises.

        Call it before the response's last byte goes out: once it returns, the record survives a
        kill -9 of this process (see the module doc).
        """
        if self._closing:
            self.dropped += 1
            log.error("writer is closed; completion of run %s not stored", rec.run_id)
            return
        if rec.capture_id is None:
            rec.capture_id = os.urandom(16).hex()  # uuid4().hex without building a UUID
        seg = None
        try:
            payload = encode(rec)
        except TypeError as exc:  # the transaction would fail too: store a plain copy (an error row)
            log.error("writer: completion of run %s cannot be serialized as is: %s", rec.run_id, exc)
            try:
                rec = storable(rec, f"not serializable: {exc}")
                payload = encode(rec)
            except (TypeError, ValueError) as exc2:  # the writer tries it alone and counts the drop
                log.error("writer: completion of run %s cannot be made storable: %s", rec.run_id, exc2)
                payload = b""
        if self.journal is not None and payload:
            try:
                seg = self.journal.append(payload)
            except OSError as exc:  # a full disk must not break the response
                self.journal.skipped += 1
                log.error("journal: append failed (%s); completion of run %s not journaled", exc, rec.run_id)
        self._enqueue(_Item(rec, len(payload), seg, False, payload))

    def may_hold(self, response_id: str) -> bool:
        """Whether a record with this Responses id is queued and not yet committed (or given up on):
        only then can a flush make a lookup that missed the store find it."""
        return response_id in self._responses

    def _enqueue(self, item: _Item) -> None:
        if item.response_id is not None:
            self._responses[item.response_id] = self._responses.get(item.response_id, 0) + 1
        if self._pending == 0:
            self._progress_at = time.monotonic()
        self._pending += 1
        self._bytes += item.size
        if self._pending >= self.max_queue or self._bytes >= self.max_queue_bytes:
            self._room.clear()
        if self._recipe is not None:
            self._send(item)
            return
        self._inbox.append(item)
        if self._sleep == _SLEEP_IDLE or (self._sleep == _SLEEP_BATCH and len(self._inbox) >= self.max_batch):
            self._signal()

    def _signal(self) -> None:
        """Wake the writer (from the caller's loop)."""
        self._sleep = _AWAKE
        self._to_writer(self._wake.set)

    async def room(self, timeout: float | None = None) -> None:
        """Return at once unless the backlog is over `max_queue` or `max_queue_bytes`; then wait
        until it is half drained. Raises StoreUnavailable when `timeout` seconds pass first."""
        if self._room.is_set():
            return
        try:
            await asyncio.wait_for(self._room.wait(), timeout)
        except TimeoutError:
            raise StoreUnavailable(
                f"the store is behind ({self._pending} records, {self._bytes} bytes not committed); "
                "retry later",
                retry_after=max(1.0, timeout or 1.0),
            ) from None

    async def reward(
        self,
        run_id: str,
        reward: float | None,
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        timeout: float | None = None,
        rubric: str | None = None,
        split: str | None = None,
    ) -> bool:
        """Store a run's reward once its earlier completions are committed.

        True: stored (the run becomes `completed`). False: this same reward was already stored.
        Raises RunNotFound (no such run), RewardConflict (a different reward is stored),
        StoreUnavailable (not committed within `timeout` seconds: the reward is withdrawn unless its
        transaction had already begun, so a retry is safe either way). `reward` None completes the
        run for the judge (`rubric`: its rubric, None = the policy's). `split` "val" makes it a
        validation run (SplitConflict when that contradicts the run).
        """
        if reward is not None and not math.isfinite(reward):
            raise ValueError("reward must be a finite number")
        if self._closing or self._task is None:
            raise StorageError("the writer is not running")
        value = float(reward) if reward is not None else None
        started = time.monotonic()
        while True:
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            op = _Reward(run_id, value, metrics, metadata, fut, rubric, split)
            op.deadline = None if timeout is None else started + timeout
            self._put_soon(op)
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
            try:
                return await asyncio.wait_for(fut, left)
            except TimeoutError:
                if self._child is not None and op.key in self._ops:  # withdrawn there too
                    self._child.send(("W", op.key))
                raise StoreUnavailable(
                    f"the store did not commit the reward of run {run_id!r} within {timeout:g} s; "
                    "retry later",
                    retry_after=max(1.0, timeout or 1.0),
                ) from None
            except RunNotFound:
                # Several replicas on one server: the run's first completion may still be queued in
                # another one's writer (it commits within its flush_interval): look again, briefly.
                waited = time.monotonic() - started + PEER_RETRY_S
                if self._engine.dialect.name == "sqlite" or waited > min(
                    PEER_GRACE_S, timeout or PEER_GRACE_S
                ):
                    raise
            await asyncio.sleep(PEER_RETRY_S)

    async def flush(self) -> None:
        """Wait until everything submitted so far is committed (or given up on)."""
        if self._closing or self._task is None:
            return
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._put_urgent(_Flush(fut))
        await fut

    async def close(self) -> None:
        """Write everything queued, then stop. Idempotent."""
        if self._closed:
            return
        self._closing = True
        if self._task is not None:
            self._close_deadline = time.monotonic() + self.drain_timeout
            self._put_urgent(_Stop())
            try:
                await self._task
            finally:
                self._task = None
        if self._child is not None:
            self._child.close_link()
            await self._child.wait(10.0)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
            self._thread = None
        elif self._conn is not None:
            await self._discard_conn()
        if self.journal is not None:
            self.journal.close()
        self._closed = True
        log.info(
            "writer closed: %d rows written, %d errors, %d dropped",
            self.rows_written,
            self.write_errors,
            self.dropped,
        )

    # -- the task -----------------------------------------------------------------------------

    def _put_soon(self, op: _Op) -> None:
        """A reward: committed with the batch being gathered (within `flush_interval`), not in a
        transaction of its own. Urgent rewards cost a commit each, and under tagged traffic with
        rewards flowing most of the writer's time was those commits (issue 24). It wakes an idle
        writer, and ends a batch that is its own run's turns alone (`_alone`): nothing else is
        coming to share either."""
        if self._pending == 0:
            self._progress_at = time.monotonic()
        self._pending += 1
        if self._recipe is not None:
            self._send(op)
            return
        first = self._soon_in == self._soon_out
        self._soon_in += 1
        if isinstance(op, _Reward):
            op.queued = time.monotonic()
        self._inbox.append(op)
        if self._sleep == _SLEEP_IDLE or (self._sleep == _SLEEP_BATCH and self._alone()):
            self._signal()
        elif self._sleep == _SLEEP_BATCH and first and self.flush_interval > REWARD_WAIT_S:
            self._to_writer(self._wake_soon)

    def _alone(self) -> bool:
        """Whether the batch being gathered is one run's turns and its reward alone (at most
        ALONE_MAX operations). `tuple()` copies the queue in one step under the interpreter lock
        (the writer's thread may be taking from it)."""
        if len(self._inbox) > ALONE_MAX:
            return False
        runs = set()
        reward = False
        for o in tuple(self._inbox):
            if isinstance(o, _Reward):
                runs.add(o.run_id)
                reward = True
            elif isinstance(o, _Item):
                runs.add(o.rec.run_id)
            else:
                return False
        return reward and len(runs) == 1

    def _wake_soon(self) -> None:
        """On the writer's loop: end the batch being gathered within REWARD_WAIT_S."""
        self._wloop.call_later(REWARD_WAIT_S, self._wake.set)

    def _put_urgent(self, op: _Op) -> None:
        if self._pending == 0:
            self._progress_at = time.monotonic()
        self._pending += 1
        if self._recipe is not None:
            self._send(op)
            return
        self._urgent_in += 1
        self._inbox.append(op)
        if self._sleep != _AWAKE:
            self._signal()

    # -- the writer process (storage/writer_link.py) -------------------------------------------

    async def _spawn(self) -> None:
        """Start a writer process and send it every operation not settled yet, in order."""
        self._child = WriterProcess(self._from_child, self._child_lost)
        await self._child.spawn({**self._recipe, "log_level": logging.getLogger().getEffectiveLevel()})
        again = self._spawned > 0  # a dead (or replaced) process may have committed some of them
        self._spawned += 1
        self._waited.clear()
        self._demoting = False  # (a process that died before its kill was lost as a death)
        if self._idle_at is not None:  # started at the normal priority (the last one starved): its
            # time there counts from now, not from the decision (a start can take seconds on a
            # loaded box: counted from the decision, it went back to idle priority, starved at once)
            self._idle_at = time.monotonic() + self._idle_after
        if self._idle_wanted and self._watch is None:
            self._watch = asyncio.get_running_loop().call_later(STARVE_CHECK_S, self._watch_priority)
        for op in list(self._ops.values()):
            wire = self._wire(op, again)
            if wire is not None:
                self._child.send(wire)

    def _send(self, op: _Op) -> None:
        self._next_key += 1
        op.key = self._next_key
        self._ops[op.key] = op
        if isinstance(op, _Item) and op.payload:
            op.rec = None  # the payload is what is sent, now and on a restart (see _Item)
        if self._child is None or not self._child.connected:
            return  # sent by `_spawn` once a process is there
        wire = self._wire(op, False)
        if wire is not None:  # a completion is journaled: it may wait for the next batch's send
            self._child.send(wire, self._item_wait if isinstance(op, _Item) else 0.0)

    def _wire(self, op: _Op, again: bool) -> tuple | None:
        """`op` as a message for the writer process (None: given up, it cannot be sent)."""
        if isinstance(op, _Item):
            try:
                payload = op.payload or encode(op.rec)
            except (TypeError, ValueError) as exc:  # not even a sanitized copy (submit logged why)
                del self._ops[op.key]
                self._give_up([op], StorageError(f"not serializable: {exc}"))
                return None
            return ("I", op.key, payload, op.replayed or again)
        if isinstance(op, _Reward):
            return (
                "R",
                op.key,
                op.run_id,
                op.reward,
                op.metrics,
                op.metadata,
                op.rubric,
                op.split,
                op.deadline,
            )
        if isinstance(op, _Flush):
            return ("F", op.key)
        left = self.drain_timeout
        if self._close_deadline is not None:
            left = max(0.0, self._close_deadline - time.monotonic())
        return ("S", op.key, left)

    def _from_child(self, msg: tuple) -> None:
        """A message of the writer process: settle what it committed or gave up, take its counters."""
        try:
            self._settle_child(msg)
        except Exception:  # a bug here must not end the link (and with it the writer process)
            log.exception("writer: a message of the writer process could not be handled")

    def _settle_child(self, msg: tuple) -> None:
        kind = msg[0]
        self._counters(msg[-1])
        if kind == "settle":
            self._deaths = 0
            self._progress_at = time.monotonic()
            ops, outcomes = [], []
            for key, outcome in msg[1]:
                op = self._ops.pop(key, None)
                if op is not None:
                    ops.append(op)
                    outcomes.append(decode_outcome(outcome))
            self._settle(ops, outcomes)
        elif kind == "give_up":
            ops = [op for key in msg[1] if (op := self._ops.pop(key, None)) is not None]
            self._give_up(ops, load_error(msg[2]), msg[3])
        elif kind == "stopped":
            for key in [k for k, op in self._ops.items() if isinstance(op, _Stop)]:
                del self._ops[key]
            self._stopped()
            if self._task is not None and not self._task.done():
                self._task.set_result(None)

    def totals(self) -> tuple[int, int, int, int, int]:
        """rows_written, commits, rewards_written, write_errors, replayed (a writer process's report)."""
        return (self.rows_written, self.commits, self.rewards_written, self.write_errors, self.replayed)

    def _counters(self, stats: tuple) -> None:
        base = self._base
        self.rows_written, self.commits, self.rewards_written, self.write_errors, self.replayed = (
            b + n for b, n in zip(base, stats[:5], strict=True)
        )
        self.last_error = stats[5]

    def _watch_priority(self) -> None:
        """Every STARVE_CHECK_S while idle priority is wanted: at idle priority, move the writer
        process to the normal one once it starves (see STARVED_SHARE); at the normal one, put it
        back at idle priority when its time there is over (see IDLE_AGAIN_S).

        The idle priority keeps its SQL from delaying requests on a busy core (docs/performance.md);
        where the cores are kept busy (a trainer or an engine on them, a burst of load) it gets only
        their leftovers. Lowering it is always allowed. Raising it from here needs CAP_SYS_NICE;
        without that, the process is replaced by one started at the normal priority (over the kill -9
        path: nothing lost, each row once)."""
        self._watch = None
        if self._task is None or self._task.done() or not self._idle_wanted:
            return
        self._watch = asyncio.get_running_loop().call_later(STARVE_CHECK_S, self._watch_priority)
        child = self._child
        if child is None or not child.connected or self._demoting:
            self._waited.clear()
            return
        now = time.monotonic()
        if self._idle_at is not None:  # at the normal priority since it starved
            if now >= self._idle_at and child.set_idle(True):
                log.info(
                    "writer process: back at idle priority after %.0f s at the normal one",
                    self._idle_after,
                )
                self._recipe["idle_priority"] = True
                self._idle_at = None
                self._idle_since = now
            return
        waited = child.waited()
        looks = self._waited
        if waited is None or not self._ops:
            looks.clear()
            return
        looks.append((now, waited))
        while len(looks) > 1 and now - looks[1][0] >= STARVED_SPAN_S:
            looks.popleft()
        span = now - looks[0][0]
        share = (waited - looks[0][1]) / span if span > 0 else 0.0
        if span < STARVED_SPAN_S or share < STARVED_SHARE:
            return
        again = self._idle_after > 0 and now - self._idle_since < IDLE_AGAIN_MAX_S
        self._idle_after = min(2 * self._idle_after, IDLE_AGAIN_MAX_S) if again else self.idle_again_s
        self._idle_at = now + self._idle_after
        self._recipe["idle_priority"] = False  # a process started from now on: the normal priority
        looks.clear()
        raised = child.set_idle(False)
        log.warning(
            "writer process: starved at idle priority (runnable but not running %.0f%% of the last"
            " %.1f s, %d operations waiting); %s; idle priority again in %.0f s",
            100 * share,
            span,
            len(self._ops),
            "now at the normal priority" if raised else "replacing it with one at the normal priority",
            self._idle_after,
        )
        if not raised:
            self._demoting = True
            child.kill()  # what it had not settled is sent again to the next one, as after a crash

    def _child_lost(self, exc: Exception | None) -> None:
        """The writer process's socket ended: expected after "stopped", else the process died."""
        if self._task is None or self._task.done():
            return
        if self._demoting:  # `_watch_priority` ended it: not a death
            self._demoting = False
            self._base = self.totals()
            self._respawn = asyncio.get_running_loop().create_task(self._restart())
            return
        self._deaths += 1
        self.restarts += 1
        self._base = self.totals()
        code = self._child.returncode() if self._child is not None else None
        log.error(
            "writer process exited (code %s) with %d operations not settled; starting another",
            code,
            len(self._ops),
        )
        self._respawn = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        old = self._child
        if old is not None:
            await old.wait(5.0)
        while True:
            await asyncio.sleep(min(0.1 * 2 ** (self._deaths - 1), MAX_BACKOFF_S))
            if self._close_deadline is not None and time.monotonic() > self._close_deadline:
                self._give_up(list(self._ops.values()), StorageError("the writer process died"), True)
                self._ops.clear()
                if self._task is not None and not self._task.done():
                    self._task.set_result(None)
                return
            try:
                await self._spawn()
                return
            except OSError as e:  # out of processes or descriptors: try again
                self._deaths += 1
                log.error("writer: cannot start a writer process: %s", e)

    async def _run(self) -> None:
        """The writer's loop: batches, each written (retried, split) before the next is taken."""
        while True:
            batch = await self._next_batch()
            stop = isinstance(batch[-1], _Stop)
            if stop:
                batch.pop()
            if batch:
                try:
                    await self._write_with_retry(batch)
                except Exception:  # the writer must outlive any bug in a batch
                    log.exception("writer: unexpected failure; %d operations given up", len(batch))
                    self._to_caller(self._give_up, batch, StorageError("the writer failed"), True)
            if stop:
                self._to_caller(self._stopped)
                return

    def _stopped(self) -> None:
        self._pending -= 1  # the stop marker
        self._room.set()

    def _check_room(self) -> None:
        if self._pending <= self.max_queue // 2 and self._bytes <= self.max_queue_bytes // 2:
            self._room.set()

    async def _next_batch(self) -> list[_Op]:
        """On the writer's loop: wait for work, gather records for up to `flush_interval` unless an
        urgent operation (reward, flush, stop) is queued, then take up to `max_batch` operations in
        queue order (a stop ends the batch). A reward first in the queue that came after the last
        batch was committed found the writer idle: everything before it is committed and nothing is
        coming to share its transaction, so it is committed once the last commit is REWARD_GAP_S
        old, at once after a pause (a reward posted a while after its run's last turn, as an app
        scoring an episode does, waited REWARD_WAIT_S for nothing)."""
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
            if isinstance(head, _Reward) and head.queued >= self._written_at:  # it found us idle
                window = min(window, self._written_at + REWARD_GAP_S - time.monotonic())
            elif self._alone():  # one run's turns and its reward: nothing else is coming
                window = 0
            if window > 0:
                await self._sleep_until(_SLEEP_BATCH, window)
        batch: list[_Op] = []
        while self._inbox and len(batch) < self.max_batch:
            op = self._inbox.popleft()
            batch.append(op)
            if isinstance(op, _Flush | _Stop):
                self._urgent_out += 1
                if isinstance(op, _Stop):
                    break
            elif isinstance(op, _Reward):
                self._soon_out += 1
        return batch

    async def _sleep_until(self, mode: int, timeout: float | None) -> None:
        self._wake.clear()
        self._sleep = mode  # after the clear: a wake-up from now on is kept
        if mode == _SLEEP_IDLE and self._inbox:  # arrived between the check and the flag
            self._sleep = _AWAKE
            return
        if mode == _SLEEP_BATCH and self._urgent_in != self._urgent_out:
            self._sleep = _AWAKE
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass
        self._sleep = _AWAKE

    async def _write_with_retry(self, batch: list[_Op]) -> None:
        attempt = 0
        while True:
            try:
                results = await self._write(batch)
            except Exception as e:
                attempt += 1
                self.write_errors += 1
                self.last_error = f"{type(e).__name__}: {e}"[:500]
                if not _is_permanent(e):  # refused values leave the connection usable (rolled back)
                    await self._discard_conn()
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
                    if isinstance(op, _Item) and not op.sanitized:  # keep it, as an error row
                        op.rec, op.sanitized = storable(op.rec, f"refused by the store: {e}"[:500]), True
                        continue
                    attempt = max(attempt, SPLIT_AFTER)  # retrying cannot change the answer
                if not transient and attempt >= SPLIT_AFTER:
                    if len(batch) > 1:
                        for op in batch:
                            await self._write_with_retry([op])
                        return
                    self._to_caller(self._give_up, batch, e, False)
                    return
                if self._close_deadline is not None and time.monotonic() > self._close_deadline:
                    self._to_caller(self._give_up, batch, e, True)
                    return
                await asyncio.sleep(min(0.05 * 2 ** (attempt - 1), MAX_BACKOFF_S))
                continue
            self._progress_at = self._written_at = time.monotonic()  # before the caller hears of it
            self.last_error = None
            self._to_caller(self._settle, batch, results)
            return

    def _settle(self, batch: list[_Op], results: list[Any]) -> None:
        """On the caller's loop: a committed batch's records, barriers and rewards are done."""
        for op, outcome in zip(batch, results, strict=True):
            self._pending -= 1
            if isinstance(op, _Item):
                self._resolved(op)
            elif isinstance(op, _Flush) and not op.future.done():
                op.future.set_result(True)
            elif isinstance(op, _Reward) and not op.future.done():
                if isinstance(outcome, BaseException):
                    op.future.set_exception(outcome)
                else:
                    op.future.set_result(bool(outcome))
        self._check_room()

    async def _repair(self, batch: list[_Op]) -> bool:
        """Move the counters of the batch's runs past their stored completions (own transaction);
        True when done (the batch is then worth retrying whole)."""
        run_ids = [op.rec.run_id for op in batch if isinstance(op, _Item) and op.rec.run_id is not None]
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

    def _resolved(self, item: _Item) -> None:
        self._bytes -= item.size
        if item.response_id is not None:
            left = self._responses.pop(item.response_id, 1) - 1
            if left > 0:
                self._responses[item.response_id] = left
        if item.seg is not None and self.journal is not None:
            self.journal.resolve(item.seg)

    def _give_up(self, batch: list[_Op], err: BaseException, keep: bool = False) -> None:
        """Stop trying `batch`. keep=True (closing): journaled records stay for the next start."""
        for op in batch:
            self._pending -= 1
            if isinstance(op, _Item):
                if keep and op.seg is not None:
                    self._bytes -= op.size
                    log.warning("writer: completion of run %s left to the journal: %s", op.run_id, err)
                    continue
                self._resolved(op)
                self.dropped += 1
                log.error("writer: dropped a completion of run %s: %s", op.run_id, err)
            elif isinstance(op, _Reward):
                if not op.future.done():
                    op.future.set_exception(StorageError(f"reward of run {op.run_id} not stored: {err}"))
            elif isinstance(op, _Flush):
                if not op.future.done():
                    op.future.set_result(False)
        self._check_room()

    async def _discard_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await conn.invalidate()
            await conn.close()
        except Exception as e:
            log.debug("writer: closing a broken connection: %s", e)

    async def _write(self, batch: list[_Op]) -> list[Any]:
        """One transaction for the batch, in queue order: each stretch of records is inserted, then
        the reward after it applied (so a reward sees its run's earlier completions). Returns one
        outcome per op (a bool or an exception for a reward, else None)."""
        items = [op for op in batch if isinstance(op, _Item)]
        if not items and not any(isinstance(op, _Reward) for op in batch):
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
                if isinstance(op, _Item):
                    if not (op.replayed and op.rec.capture_id in have):
                        stretch.append(op.rec)
                        replayed_n += op.replayed
                    outcomes.append(None)
                    continue
                if stretch:
                    written += await self._insert(conn, stretch, now)
                    stretch = []
                if isinstance(op, _Reward) and not op.withdrawn():  # the caller timed out
                    outcomes.append(
                        await apply_reward(
                            conn, op.run_id, op.reward, op.metrics, op.metadata, now, op.rubric, op.split
                        )
                    )
                else:
                    outcomes.append(None)
            if stretch:
                written += await self._insert(conn, stretch, now)
        self.rows_written += written
        self.commits += 1
        self.replayed += replayed_n
        self.rewards_written += sum(1 for o in outcomes if o is True)
        return outcomes

    @staticmethod
    async def _insert(conn: AsyncConnection, records: list[CompletionRecord], now: datetime) -> int:
        first_seq = await ensure_runs(conn, records)  # locks the runs' rows until the commit
        return await insert_completions(conn, records, first_seq, now)


def _in_memory(engine: AsyncEngine) -> bool:
    """An in-memory SQLite database: every connection of another loop would see another database."""
    url = engine.url.render_as_string(hide_password=False)
    return is_sqlite(url) and sqlite_path(url) is None


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
    return isinstance(e, TypeError | ValueError | OverflowError | UnicodeError)


def _is_transient(e: BaseException) -> bool:
    """Errors that waiting can fix: locks, lost connections, a database restarting."""
    if isinstance(e, exc.DBAPIError):
        if e.connection_invalidated:
            return True
        if getattr(e.orig, "sqlstate", None) in _RETRY_SQLSTATES:
            return True
        if isinstance(e, exc.OperationalError | exc.InterfaceError):
            return True
        return False
    return isinstance(e, OSError | ConnectionError | TimeoutError | exc.DisconnectionError)
