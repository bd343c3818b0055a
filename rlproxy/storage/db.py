"""Engines and migrations: the one place that knows how rlproxy talks to SQLite and PostgreSQL.

SQLite is the default store and also the user interface (`sqlite3 rlproxy.db "SELECT ..."`), so
every connection gets the same pragmas: WAL (readers never block the writer), a busy timeout
(a second process waits instead of failing), foreign keys on, and `synchronous=NORMAL` (in WAL
mode a commit survives a process crash; only a power loss can drop the last transactions).

Read-only engines are enforced by the database, not by inspecting SQL: SQLite opens the file
with the URI flag `mode=ro` and a limit of zero attached databases; PostgreSQL runs every
transaction `READ ONLY`. `rlproxy sql` uses them for users' ad-hoc queries.

(Over 400 lines: one concept, a store URL and what opening it means: the engines, the migration
run (its file lock, its retry on a locked file), the start-up check and the file watch all apply
the same URL rules (`normalize_url`, `sqlite_path`) and SQLite's pragmas and locks.)
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import sqlite3
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import orjson
import sqlalchemy
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateColumn

from rlproxy.errors import StorageError
from rlproxy.storage.inline import InlineEngine

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
BUSY_TIMEOUT_MS = 10_000
# How a writer asks for SQLite's write lock up front (see `connect_write`); readers use plain BEGIN.
SQLITE_BEGIN = "rlproxy_sqlite_begin"


@compiles(CreateColumn, "sqlite")
def _sqlite_column_comment(element: CreateColumn, compiler: Any, **kw: Any) -> str:
    """Keep column comments in SQLite's DDL, so `sqlite3 rlproxy.db .schema` documents itself.

    SQLite has no COMMENT ON, but it stores each CREATE TABLE's text verbatim, comments included.
    """
    text = compiler.visit_create_column(element, **kw)
    comment = element.element.comment
    if text and comment:
        text += " /* " + comment.replace("*/", "* /") + " */"
    return text


def normalize_url(url_or_path: str) -> str:
    """A SQLAlchemy async URL for a URL or a bare SQLite path.

    `rlproxy.db`, `./x.db`, `sqlite:///x.db` -> `sqlite+aiosqlite:////abs/x.db` (absolute, so that
    a server started elsewhere and the CLI agree on the file); `postgres://`, `postgresql://` and
    `postgresql+psycopg://` -> `postgresql+asyncpg://` (the store is async end to end). A bare
    path may hold any character: `%`, `?` and `#` are escaped in the URL.
    """
    s = str(url_or_path).strip()
    if "://" not in s:
        if s in ("", ":memory:"):
            return "sqlite+aiosqlite://"
        return f"sqlite+aiosqlite:///{_escape(str(Path(s).expanduser().resolve()))}"
    scheme, rest = s.split("://", 1)
    base = scheme.split("+", 1)[0]
    if base == "sqlite":
        if rest.startswith("/") and len(rest) > 1 and not rest.startswith("/file:"):
            path, query = rest[1:], ""
            if "?" in path:
                path, query = path.split("?", 1)
                query = "?" + query
            if path and path != ":memory:" and not path.startswith("/"):
                path = _escape(str(Path(unquote(path)).expanduser().resolve()))
            return f"sqlite+aiosqlite:///{path}{query}"
        return f"sqlite+aiosqlite://{rest}"
    if base in ("postgres", "postgresql"):
        return f"postgresql+asyncpg://{rest}"
    return s


def _escape(path: str) -> str:
    # SQLAlchemy percent-decodes the database part of a URL; these would end it or be decoded.
    return path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def is_sqlite(url_or_engine: str | AsyncEngine) -> bool:
    """True when the URL or engine is a SQLite one."""
    if isinstance(url_or_engine, AsyncEngine):
        return url_or_engine.dialect.name == "sqlite"
    return make_url(normalize_url(url_or_engine)).get_backend_name() == "sqlite"


def sqlite_path(url: str) -> str | None:
    """The database file of a SQLite URL (None for in-memory)."""
    u = make_url(normalize_url(url))
    db = u.database
    if not db or db == ":memory:":
        return None
    return db[5:] if db.startswith("file:") else db


def _never_create(url: str) -> str:
    """`url` for a SQLite file that exists, as a URI whose connections open it read-write but never
    create it (`mode=rw`): a connection a pool opens after the file was deleted or moved then fails
    ("unable to open database file") rather than making an empty store at its path, which the
    writer would fill while /healthz saw another file (StoreFile). Any other URL as it is."""
    u = make_url(url)
    path = sqlite_path(url)
    if path is None or u.query or (u.database or "").startswith("file:") or not os.path.isfile(path):
        return url
    return f"{u.drivername}:///file:{_escape(quote(path, safe='/'))}?mode=rw&uri=true"


def json_bytes(obj: Any) -> bytes:
    """`obj` as JSON: NaN and infinities as null (json.dumps would write `Infinity`, which neither
    SQLite's json functions nor PostgreSQL accept; logprobs can be -inf), and keys that are not
    strings written as strings. Raises TypeError for values JSON cannot hold.

    Tried first without orjson's non-string-key option, which costs ~1 us more per completion
    record and changes nothing when every key is a string (the usual case: parsed JSON); a key that
    is not a string raises TypeError there, and the same call with the option then writes it."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


def _json_dumps(obj: Any) -> str:
    return json_bytes(obj).decode()


# An escaped U+0000 (`\u0000`) not itself preceded by an escaped backslash (`\\u0000` is the text
# backslash, u, 0000 and stays as it is)
_NUL_ESCAPE = re.compile(rb"(?<!\\)((?:\\\\)*)\\u0000")


def pg_text(value: str) -> str:
    """`value` as a PostgreSQL text column can hold it: U+0000 as U+FFFD (see `_pg_json_dumps`)."""
    return value.replace("\x00", "\ufffd") if "\x00" in value else value


def _pg_json_dumps(obj: Any) -> str:
    """JSON for a PostgreSQL column: U+0000 in a string written as U+FFFD. PostgreSQL's text cannot
    hold U+0000 and its JSON operators (`->>`, the `trajectories` view, `::jsonb`) refuse a `\\u0000`
    escape, so one such character in a model's answer made the run unreadable (issue 55). Replaced,
    not stripped or escaped: the text keeps its length and position and says something was there,
    as a lone surrogate becomes U+FFFD (`records.storable`); the answer's exact tokens are its
    `token_ids`. Clients cannot send U+0000 (refused at the edge), so only an upstream's text has
    it. SQLite holds it as is."""
    data = json_bytes(obj)
    if b"\\u0000" in data:  # one scan of the bytes; the rewrite only when there is one
        data = _NUL_ESCAPE.sub(rb"\1\\ufffd", data)
    return data.decode()


def _sqlite_factory(readonly: bool, statement_timeout_s: float | None) -> type[sqlite3.Connection]:
    """A sqlite3.Connection class with the limits set where SQLite enforces them.

    readonly: no attached databases (the `mode=ro` flag covers the main file only).
    statement_timeout_s: a statement running longer is interrupted ("interrupted" error): the
    trace callback marks each statement's start, the progress handler checks the clock.
    """

    class _Connection(sqlite3.Connection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if readonly:
                self.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
            if statement_timeout_s:
                self._deadline = float("inf")
                self.set_trace_callback(self._started)
                self.set_progress_handler(self._check, 10_000)

        def _started(self, _sql: str) -> None:
            self._deadline = time.monotonic() + statement_timeout_s  # type: ignore[operator]

        def _check(self) -> int:
            return 1 if time.monotonic() > self._deadline else 0

    return _Connection


def create_engine(
    url: str,
    *,
    readonly: bool = False,
    busy_timeout_ms: int = BUSY_TIMEOUT_MS,
    statement_timeout_s: float | None = None,
    **kwargs: Any,
) -> AsyncEngine:
    """An async engine for `url` (a URL or a SQLite path) with rlproxy's connection settings.

    `readonly=True` gives an engine whose connections the database itself refuses to write with.
    `busy_timeout_ms`: how long a SQLite connection waits for another process's lock before it
    fails with "database is locked". `statement_timeout_s`: statements running longer fail (for
    users' ad-hoc queries). Extra keyword arguments go to `create_async_engine`. A SQLite file that
    exists now is never created again by this engine's connections (`_never_create`).
    """
    engine = _create_engine(url, readonly, busy_timeout_ms, statement_timeout_s, dict(kwargs))
    _ORIGIN[engine.sync_engine] = (url, readonly, busy_timeout_ms, statement_timeout_s, kwargs)
    return engine


# How each engine of create_engine was made (clone_engine makes the same one for another loop).
_ORIGIN: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


def clone_engine(engine: AsyncEngine) -> AsyncEngine:
    """A new engine like `engine` (same URL and connection settings), for another event loop: an
    engine's connections belong to the loop that opened them (the writer's thread has its own)."""
    origin = _ORIGIN.get(engine.sync_engine)
    if origin is None:
        return create_engine(engine.url.render_as_string(hide_password=False))
    url, readonly, busy_timeout_ms, statement_timeout_s, kwargs = origin
    return create_engine(
        url,
        readonly=readonly,
        busy_timeout_ms=busy_timeout_ms,
        statement_timeout_s=statement_timeout_s,
        **kwargs,
    )


def engine_recipe(engine: AsyncEngine) -> dict[str, Any] | None:
    """How to make `engine` again in another process (a writer process: storage/writer_link.py),
    as plain data; None when it was not made by `create_engine` with rlproxy's own options only
    (read-only, statement timeouts and extra engine options stay in the process that made them)."""
    origin = _ORIGIN.get(engine.sync_engine)
    if origin is None:
        return None
    url, readonly, busy_timeout_ms, statement_timeout_s, kwargs = origin
    if readonly or statement_timeout_s or kwargs:
        return None
    return {"url": url, "busy_timeout_ms": busy_timeout_ms}


def _create_engine(
    url: str, readonly: bool, busy_timeout_ms: int, statement_timeout_s: float | None, kwargs: dict[str, Any]
) -> AsyncEngine:
    url = normalize_url(url)
    u = make_url(url)
    pg = u.get_backend_name() == "postgresql"
    kwargs.setdefault("json_serializer", _pg_json_dumps if pg else _json_dumps)
    kwargs.setdefault("json_deserializer", orjson.loads)
    if u.get_backend_name() == "sqlite":
        return _sqlite_engine(url, readonly, busy_timeout_ms, statement_timeout_s, kwargs)
    if u.get_backend_name() == "postgresql":
        args = dict(kwargs.pop("connect_args", {}))
        settings = dict(args.get("server_settings", {}))
        if readonly:
            settings["default_transaction_read_only"] = "on"
            kwargs.setdefault("execution_options", {"postgresql_readonly": True})
        if statement_timeout_s:
            settings["statement_timeout"] = str(max(1, int(statement_timeout_s * 1000)))
        if settings:
            args["server_settings"] = settings
        kwargs["connect_args"] = args
        kwargs.setdefault("pool_pre_ping", True)
        return create_async_engine(url, **kwargs)
    return create_async_engine(url, **kwargs)


def _sqlite_engine(
    url: str, readonly: bool, busy_timeout_ms: int, statement_timeout_s: float | None, kwargs: dict[str, Any]
) -> AsyncEngine:
    args = dict(kwargs.pop("connect_args", {}))
    args.setdefault("timeout", busy_timeout_ms / 1000)
    if readonly:
        path = sqlite_path(url)
        if path is None:
            raise ValueError("a read-only engine needs a database file, not :memory:")
        if not Path(path).exists():
            raise FileNotFoundError(f"no database at {path}")
        # SQLite decodes %XX in a URI filename, SQLAlchemy decodes the URL once before that.
        url = f"sqlite+aiosqlite:///file:{_escape(quote(path, safe='/'))}?mode=ro&uri=true"
    else:
        url = _never_create(url)
    if readonly or statement_timeout_s:
        args["factory"] = _sqlite_factory(readonly, statement_timeout_s)
    engine = create_async_engine(url, connect_args=args, **kwargs)
    _sqlite_events(engine.sync_engine, readonly, busy_timeout_ms)
    return engine


def writer_engine(engine: AsyncEngine) -> AsyncEngine | InlineEngine:
    """The engine the writer's thread writes with (storage/writer.py): for a SQLite file, the same
    connection settings over plain `sqlite3`, awaited inline (storage/inline.py says why); for
    another database, a clone of `engine` for the thread's own loop."""
    origin = _ORIGIN.get(engine.sync_engine)
    if engine.dialect.name != "sqlite" or origin is None or origin[1] or origin[3]:
        return clone_engine(engine)
    url, _readonly, busy_timeout_ms, _timeout, kwargs = origin
    if set(kwargs) - {"json_serializer", "json_deserializer", "connect_args"}:
        return clone_engine(engine)  # options made for the async driver (a pool class, ...)
    kwargs = dict(kwargs)
    kwargs.setdefault("json_serializer", _json_dumps)
    kwargs.setdefault("json_deserializer", orjson.loads)
    args = dict(kwargs.pop("connect_args", {}))
    args.setdefault("timeout", busy_timeout_ms / 1000)
    sync_url = make_url(_never_create(normalize_url(url))).set(drivername="sqlite+pysqlite")
    sync = sqlalchemy.create_engine(sync_url, connect_args=args, **kwargs)
    _sqlite_events(sync, False, busy_timeout_ms)
    return InlineEngine(sync)


def _sqlite_events(sync_engine: Any, readonly: bool, busy_timeout_ms: int) -> None:
    """Every SQLite connection's pragmas, and BEGIN in the mode a writer asks for."""

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Driver-level autocommit: SQLAlchemy emits BEGIN itself (below), so that a writer can ask
        # for BEGIN IMMEDIATE and pragmas run outside any transaction.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if not readonly:
            cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cur.execute("PRAGMA foreign_keys=ON")
        if not readonly:
            cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        mode = conn.get_execution_options().get(SQLITE_BEGIN, "")
        conn.exec_driver_sql(f"BEGIN {mode}".strip())


async def connect_write(engine: AsyncEngine) -> AsyncConnection:
    """A connection whose transactions take SQLite's write lock at BEGIN (BEGIN IMMEDIATE).

    A deferred transaction that reads and then writes can fail at once with SQLITE_BUSY when
    another process wrote in between (the busy timeout cannot help it); an immediate one waits its
    turn instead. On PostgreSQL this is a plain connection. Use `async with await connect_write(e)
    as conn, conn.begin(): ...`.
    """
    conn = await engine.connect()
    if engine.dialect.name == "sqlite":
        conn = await conn.execution_options(**{SQLITE_BEGIN: "IMMEDIATE"})
    return conn


@asynccontextmanager
async def write_transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One write transaction holding SQLite's write lock from its start; raising inside rolls it back."""
    conn = await connect_write(engine)
    try:
        async with conn.begin():
            yield conn
    finally:
        await conn.close()


def alembic_config(url: str) -> Any:
    """Alembic's Config for `url`, built in code so that it works from an installed package."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply the Alembic migrations up to `revision` (blocking; call from sync code or a thread)."""
    from alembic import command

    if is_sqlite(url):
        path = sqlite_path(url)
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    log.info("migrating %s to %s", _redact(url), revision)
    with _migration_lock(url):
        _upgrade_retrying(command, url, revision)


@contextmanager
def _migration_lock(url: str) -> Iterator[None]:
    """Processes migrating one SQLite file take turns (an flock on the file itself, which SQLite's own
    POSIX locks ignore): without it two fresh starts can both read the old version and both apply
    the next migration (`duplicate column name`). PostgreSQL serializes on an advisory lock instead
    (migrations/env.py)."""
    path = sqlite_path(url) if is_sqlite(url) else None
    if not path:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # an empty file is an empty SQLite database
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _upgrade_retrying(command: Any, url: str, revision: str) -> None:
    for attempt in range(5):
        try:
            _in_thread(command.upgrade, alembic_config(url), revision)
            return
        except OperationalError as exc:
            # Processes starting together on a fresh SQLite file (serve + train) can find it locked
            # while another one switches it to WAL or migrates; once that is done, this is a no-op.
            if attempt == 4 or "locked" not in str(exc):
                raise
            log.warning("database is locked while migrating; retrying (%s)", exc.orig)
            time.sleep(0.5 * (attempt + 1))


def downgrade(url: str, revision: str = "base") -> None:
    """Undo migrations down to `revision` (`base` drops every rlproxy table and view)."""
    from alembic import command

    _in_thread(command.downgrade, alembic_config(url), revision)


async def upgrade_async(url: str, revision: str = "head") -> None:
    """`upgrade` from async code: Alembic runs its own event loop, so it runs in a worker thread."""
    await asyncio.to_thread(upgrade, url, revision)


def _in_thread(fn: Any, *args: Any) -> None:
    # Alembic's env.py runs its own event loop (asyncio.run); a private thread keeps that loop
    # from touching the caller's thread's event loop, whatever the caller is.
    with ThreadPoolExecutor(1, thread_name_prefix="rlproxy-migrate") as ex:
        ex.submit(fn, *args).result()


async def check_store(url: str, timeout: float = 10.0) -> None:
    """Raise a one-line StorageError when `url` names no store rlproxy can open: not a database URL,
    a database other than SQLite or PostgreSQL, a SQLite file in a folder that does not exist, a
    PostgreSQL server that does not answer within `timeout` seconds. Nothing is created."""
    try:
        u = make_url(normalize_url(url))
    except Exception:
        raise StorageError(f"not a database URL: {url!r} (a SQLite file path, or postgresql://...)") from None
    backend = u.get_backend_name()
    if backend == "sqlite":
        path = sqlite_path(str(u))
        if path is not None and not Path(path).parent.is_dir():
            raise StorageError(f"no folder {Path(path).parent} for the database file {path}")
        return
    if backend != "postgresql":
        raise StorageError(
            f"unsupported database {backend!r} in {_redact(url)}: use a SQLite file path or postgresql://..."
        )
    engine = create_async_engine(str(u), connect_args={"timeout": timeout})
    try:
        async with asyncio.timeout(timeout + 1):
            async with engine.connect():
                pass
    except Exception as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        raise StorageError(
            f"cannot reach the database {_redact(url)}: {reason[0] if reason else type(exc).__name__}"
        ) from None
    finally:
        await engine.dispose()


def _redact(url: str) -> str:
    try:
        return make_url(normalize_url(url)).render_as_string(hide_password=True)
    except Exception:  # only for a log line
        return "<url>"


class StoreFile:
    """The SQLite file a serving process writes to, watched for being deleted or replaced (issue 22).

    A file deleted (or moved, or replaced by another) while `serve` runs keeps taking writes on the
    old, unlinked inode: every acknowledged reward would be lost at the next start. `fault()` compares
    the path's (device, inode) with the ones seen at start, a stat per call (the `/healthz` check and
    each reward ask it): `file_missing` or `file_replaced` then, else None. PostgreSQL: always None.

    `preflight()` refuses to serve a store whose `-wal` or `-shm` sidecar cannot be written (a
    read-only `-shm` makes SQLite map it read-only and the process die of SIGBUS at its first write,
    with no log line): a StorageError that names the file, before any request.
    """

    def __init__(self, url: str) -> None:
        self.path = sqlite_path(url) if is_sqlite(url) else None
        self.identity: tuple[int, int] | None = None

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)  # type: ignore[arg-type]
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def preflight(self) -> None:
        if self.path is None:
            return
        for sidecar in (self.path + "-wal", self.path + "-shm"):
            if not os.path.exists(sidecar):
                continue
            try:
                with open(sidecar, "r+b"):
                    pass
            except OSError as exc:
                raise StorageError(
                    f"{sidecar} cannot be written ({exc.strerror}): SQLite would crash the process "
                    "(SIGBUS) at its first write; give this process write access to it, or remove it "
                    "while no process uses the store"
                ) from None

    def remember(self) -> None:
        """Note the file's identity (after the migrations made sure it exists)."""
        if self.path is not None:
            self.identity = self._stat()

    def fault(self) -> str | None:
        if self.path is None or self.identity is None:
            return None
        now = self._stat()
        if now is None:
            return "file_missing"
        return "file_replaced" if now != self.identity else None
