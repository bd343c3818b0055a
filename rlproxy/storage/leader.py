"""The leader lock: one trainer per store across the fleet; the others stand by and take over.

Several `serve --train` replicas (or a `serve --train` and an `rlproxy train`) may point at one
store. Exactly one of them trains: the one holding this lock. The others poll for it every
`retry` seconds and log that they stand by; when the leader dies its lock goes with it, and the
next poll of a standby takes it.

- PostgreSQL: a session-level advisory lock (`pg_try_advisory_lock`) held on a dedicated
  connection in autocommit (no transaction stays open). A process that dies, even by SIGKILL, closes
  its socket; the server ends the session and frees the lock at once. The holder pings its
  connection before each step (`still_held`): a lost connection means a lost lock, and the trainer
  goes back to standing by. A brief overlap (a leader cut off from the database while a new one
  starts) cannot commit a step twice: `training_steps (policy, step)` is unique and the step's
  runs must still be `completed` (storage/training.py, StepConflict).
- SQLite: an exclusive `flock` on `<db file>.trainer.lock` next to the database. SQLite is one
  host's file, so a file lock reaches every process that can open it; the kernel drops it when the
  process dies. An in-memory database has one process by definition: always held.

One lock per store, for every policy: the leader trains all of them (one model in memory per
policy on one trainer, as before).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rlproxy.storage.db import create_engine, is_sqlite, sqlite_path

log = logging.getLogger(__name__)


def lock_key(name: str) -> int:
    """The advisory lock key of `name`: a signed 64-bit integer from its SHA-256."""
    return int.from_bytes(hashlib.sha256(f"rlproxy:{name}".encode()).digest()[:8], "big", signed=True)


class LeaderLock:
    """Whether this process is the one that trains on the store at `db_url` (see module doc)."""

    def __init__(self, db_url: str, name: str = "trainer", retry: float = 1.0) -> None:
        self.db_url = db_url
        self.name = name
        self.retry = retry  # seconds between two tries of a standby
        self.held = False
        self._engine: AsyncEngine | None = None
        self._conn: AsyncConnection | None = None
        self._fd: int | None = None

    @property
    def where(self) -> str:
        """How the lock is held, for logs: advisory lock, file lock or none."""
        if not is_sqlite(self.db_url):
            return f"PostgreSQL advisory lock {lock_key(self.name)}"
        path = sqlite_path(self.db_url)
        return f"file lock {path}.{self.name}.lock" if path else "none (in-memory database)"

    async def try_acquire(self) -> bool:
        """Take the lock if it is free; True while this process holds it."""
        if self.held:
            return True
        try:
            self.held = await (self._try_pg() if not is_sqlite(self.db_url) else self._try_file())
        except Exception as exc:  # the database is unreachable: not leader, try again later
            log.warning("leader lock (%s): cannot try it: %s", self.where, exc)
            await self._drop_conn()
            self.held = False
        return self.held

    async def acquire(self) -> None:
        """Wait until this process holds the lock, logging once that it stands by."""
        if await self.try_acquire():
            log.info("leader: this process trains (%s)", self.where)
            return
        log.info(
            "standing by: another process holds the trainer's lock (%s); trying every %.1f s",
            self.where,
            self.retry,
        )
        while not await self.try_acquire():
            await asyncio.sleep(self.retry)
        log.info("leader: took over training (%s)", self.where)

    async def still_held(self) -> bool:
        """Whether the lock is still ours: on PostgreSQL, whether its connection is alive."""
        if not self.held or self._conn is None:
            return self.held
        try:
            await self._conn.execute(text("SELECT 1"))
            return True
        except Exception as exc:
            log.warning("leader lock (%s) lost with its connection: %s", self.where, exc)
            await self._drop_conn()
            self.held = False
            return False

    async def release(self) -> None:
        """Give the lock up (closing its connection or file frees it). Idempotent."""
        self.held = False
        await self._drop_conn()
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    # -- the two kinds --------------------------------------------------------------------------

    async def _try_pg(self) -> bool:
        if self._engine is None:
            self._engine = create_engine(self.db_url)
        if self._conn is None:
            conn = await self._engine.connect()
            self._conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        got = await self._conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": lock_key(self.name)})
        return bool(got.scalar())

    async def _try_file(self) -> bool:
        path = sqlite_path(self.db_url)
        if not path:
            return True
        if self._fd is None:
            lock_path = Path(f"{path}.{self.name}.lock")
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    async def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.close()
            except Exception as exc:
                log.debug("leader lock: closing its connection: %s", exc)
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await engine.dispose()
