"""The single writer: every captured completion and every reward reaches SQL through here.

Why one writer: SQLite allows one writing transaction at a time, and `seq` (0,1,2,... per run)
must be gapless. A FIFO queue feeding one connection gives both without locks: the writer task
takes what has queued up (for `flush_interval` seconds or `max_batch` operations), writes it in one
transaction (`BEGIN IMMEDIATE` on SQLite), and only then moves on. A reward travels through the same
queue, so by the time it is applied every completion submitted before it for its run is committed
in the same or an earlier transaction (how soon: `runner.LoopRunner.put`); the caller awaits a
future resolved after the commit.

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

Where a batch's SQL runs is a `runner.Runner`: on the caller's loop (an in-memory SQLite
database), on a thread of its own (`thread=True`, the default otherwise) or in a writer process
(`process=True`, what `serve` uses: `writer_process.py`); `runner.py` says what measurement keeps each.
This class stays on the caller's loop whatever the runner: it journals and queues (`submit`),
and settles what the runner reports (counters, journal segments, reward futures), so all
bookkeeping is the caller's loop's alone. The SQL of a transaction is in `rows.py`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.errors import StorageError
from rlproxy.storage.db import engine_recipe, is_sqlite, sqlite_path
from rlproxy.storage.errors import RunNotFound, StoreUnavailable
from rlproxy.storage.journal import Journal, encode
from rlproxy.storage.records import CompletionRecord, storable
from rlproxy.storage.runner import STATS, Flush, Item, LoopRunner, Op, Reward, Runner, Stop, ThreadRunner
from rlproxy.storage.writer_process import ProcessRunner

log = logging.getLogger(__name__)

# A reward for a run the database does not know yet, on a store several replicas write (PostgreSQL):
# looked up again every PEER_RETRY_S for PEER_GRACE_S before the 404, since the replica that served
# the run's first completion commits it up to its flush_interval (0.05 s) + a transaction later.
PEER_GRACE_S = 1.0
PEER_RETRY_S = 0.05


class Writer:
    """Queues completions and rewards for a `Runner` and settles what it commits (see module doc)."""

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
        self._engine = engine
        # process=True: a writer process when the engine can be made again there (a database file
        # or server, no options that cannot travel); thread None: a thread unless in-memory SQLite
        recipe = engine_recipe(engine) if process and not _in_memory(engine) else None
        self.runner: Runner
        if recipe is not None:
            self.runner = ProcessRunner(recipe, flush_interval, max_batch, idle_priority)
        elif thread if thread is not None else not _in_memory(engine):
            self.runner = ThreadRunner(engine, flush_interval, max_batch)
        else:
            self.runner = LoopRunner(engine, flush_interval, max_batch)
        # Backpressure: past `max_queue` uncommitted operations or `max_queue_bytes` bytes `room()`
        # waits until the backlog is half drained, so a sustained overload slows requests to the
        # database's pace instead of growing memory (and full garbage collections over the queued
        # records) without bound.
        self.max_queue = max(1, max_queue)
        self.max_queue_bytes = max(1, max_queue_bytes)
        self.journal = journal
        self.drain_timeout = drain_timeout  # close(): how long to keep retrying a failing database
        self._bytes = 0
        self._pending = 0
        self._progress_at = time.monotonic()  # last commit, or when the queue last became non-empty
        self._room = asyncio.Event()
        self._room.set()
        self._started = self._closing = self._closed = False
        # Responses ids of queued records (id -> how many): `may_hold` says whether a read that missed
        # the store should flush the queue and look again
        self._responses: dict[str, int] = {}
        # the runner's counters (runner.STATS), as of its last report
        self.rows_written = 0  # completions committed
        self.commits = 0  # transactions committed
        self.rewards_written = 0
        self.write_errors = 0  # failed transaction attempts (each one retried)
        self.replayed = 0  # journal records stored on start (committed before the crash or not)
        self.last_error: str | None = None  # of the last failed transaction, cleared by a commit
        self.dropped = 0  # records given up on (logged); 0 unless a record cannot be stored at all
        # sees each record handed over and each new reward once committed (the live OTLP export,
        # traces/otlp_live.py): it must return at once and never raise
        self.tap: Callable[[CompletionRecord | Reward], None] | None = None

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
        return self.runner.idle_priority

    @property
    def restarts(self) -> int:
        """Writer processes that died and were replaced (process=True)."""
        return self.runner.restarts

    def stalled_for(self) -> float:
        """Seconds work has been waiting without a commit (0 when the queue is empty)."""
        if self._pending == 0:
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    async def start(self) -> None:
        """Start the runner (idempotent)."""
        if not self._started:
            self._started = True
            await self.runner.start(self._report)

    async def recover(self, timeout: float | None = None) -> int:
        """Queue the journal's records left by a dead process, then wait (up to `timeout` seconds)
        until they are committed. Records already in the store are skipped. Returns how many."""
        if self.journal is None:
            return 0
        found = await asyncio.to_thread(self.journal.recover)
        n = 0
        for seg, records in found:
            for rec in records:
                self._put(Item(rec, 0, seg, True))
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
            except (TypeError, ValueError) as exc2:  # the runner tries it alone and counts the drop
                log.error("writer: completion of run %s cannot be made storable: %s", rec.run_id, exc2)
                payload = b""
        if self.journal is not None and payload:
            try:
                seg = self.journal.append(payload)
            except OSError as exc:  # a full disk must not break the response
                self.journal.skipped += 1
                log.error("journal: append failed (%s); completion of run %s not journaled", exc, rec.run_id)
        self._put(Item(rec, len(payload), seg, False, payload))
        if self.tap is not None:
            self.tap(rec)

    def may_hold(self, response_id: str) -> bool:
        """Whether a record with this Responses id is queued and not yet committed (or given up on):
        only then can a flush make a lookup that missed the store find it."""
        return response_id in self._responses

    def _put(self, op: Op) -> None:
        if self._pending == 0:
            self._progress_at = time.monotonic()
        self._pending += 1
        if isinstance(op, Item):
            if op.response_id is not None:
                self._responses[op.response_id] = self._responses.get(op.response_id, 0) + 1
            self._bytes += op.size
            if self._pending >= self.max_queue or self._bytes >= self.max_queue_bytes:
                self._room.clear()
        self.runner.put(op)

    async def room(self, timeout: float | None = None) -> None:
        """Return at once unless the backlog is over `max_queue` or `max_queue_bytes`; then wait
        until it is half drained. Raises StoreUnavailable when `timeout` seconds pass first."""
        if self._room.is_set():
            return
        try:
            await asyncio.wait_for(self._room.wait(), timeout)
        except TimeoutError:
            behind = f"the store is behind ({self._pending} records, {self._bytes} bytes not committed)"
            raise _unavailable(behind, timeout) from None

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
        if self._closing or not self._started:
            raise StorageError("the writer is not running")
        value = float(reward) if reward is not None else None
        started = time.monotonic()
        while True:
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            deadline = None if timeout is None else started + timeout  # withdrawn past it
            self._put(Reward(run_id, value, metrics, metadata, fut, rubric, split, deadline=deadline))
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
            try:
                return await asyncio.wait_for(fut, left)
            except TimeoutError:
                late = f"the store did not commit the reward of run {run_id!r} within {timeout:g} s"
                raise _unavailable(late, timeout) from None
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
        if self._closing or not self._started:
            return
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._put(Flush(fut))
        await fut

    async def close(self) -> None:
        """Write everything queued (retrying a failing store for `drain_timeout`), then stop.
        Idempotent."""
        if self._closed:
            return
        self._closing = True
        if self._started:
            self._put(Stop(time.monotonic() + self.drain_timeout))
            await self.runner.join()
        if self.journal is not None:
            self.journal.close()
        self._closed = True
        log.info(
            "writer closed: %d rows written, %d errors, %d dropped",
            self.rows_written,
            self.write_errors,
            self.dropped,
        )

    # -- what the runner reports (on the caller's loop) ----------------------------------------

    def _report(self, msg: tuple) -> None:
        """("settle", ops, outcomes, stats), ("give_up", ops, error, keep, stats), ("stopped",
        stats) or ("stats", stats): `stats` are the runner's counters (runner.STATS)."""
        kind = msg[0]
        for name, value in zip(STATS, msg[-1], strict=True):
            setattr(self, name, value)
        if kind == "settle":
            self._settle(msg[1], msg[2])
        elif kind == "give_up":
            self._give_up(msg[1], msg[2], msg[3])
        elif kind == "stopped":
            self._pending -= 1  # the stop marker
            self._room.set()

    def _settle(self, batch: list[Op], results: list[Any]) -> None:
        """A committed batch's records, barriers and rewards are done."""
        self._progress_at = time.monotonic()
        for op, outcome in zip(batch, results, strict=True):
            self._pending -= 1
            if isinstance(op, Item):
                self._resolved(op)
            elif isinstance(op, Flush) and not op.future.done():
                op.future.set_result(True)
            elif isinstance(op, Reward) and not op.future.done():
                if isinstance(outcome, BaseException):
                    op.future.set_exception(outcome)
                else:
                    op.future.set_result(bool(outcome))
                    if outcome is True and op.reward is not None and self.tap is not None:
                        self.tap(op)
        self._check_room()

    def _resolved(self, item: Item) -> None:
        self._bytes -= item.size
        if item.response_id is not None:
            left = self._responses.pop(item.response_id, 1) - 1
            if left > 0:
                self._responses[item.response_id] = left
        if item.seg is not None and self.journal is not None:
            self.journal.resolve(item.seg)

    def _give_up(self, batch: list[Op], err: BaseException, keep: bool) -> None:
        """Stop trying `batch`. keep=True (closing): journaled records stay for the next start."""
        for op in batch:
            self._pending -= 1
            if isinstance(op, Item):
                if keep and op.seg is not None:
                    self._bytes -= op.size
                    log.warning("writer: completion of run %s left to the journal: %s", op.run_id, err)
                    continue
                self._resolved(op)
                self.dropped += 1
                log.error("writer: dropped a completion of run %s: %s", op.run_id, err)
            elif isinstance(op, Reward):
                if not op.future.done():
                    op.future.set_exception(StorageError(f"reward of run {op.run_id} not stored: {err}"))
            elif isinstance(op, Flush):
                if not op.future.done():
                    op.future.set_result(False)
        self._check_room()

    def _check_room(self) -> None:
        if self._pending <= self.max_queue // 2 and self._bytes <= self.max_queue_bytes // 2:
            self._room.set()


def _in_memory(engine: AsyncEngine) -> bool:
    """An in-memory SQLite database: every connection of another loop would see another database."""
    url = engine.url.render_as_string(hide_password=False)
    return is_sqlite(url) and sqlite_path(url) is None


def _unavailable(what: str, timeout: float | None) -> StoreUnavailable:
    return StoreUnavailable(f"{what}; retry later", retry_after=max(1.0, timeout or 1.0))
