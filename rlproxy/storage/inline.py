"""A synchronous SQLAlchemy engine behind the slice of `AsyncEngine` the writer uses.

The writer runs its SQL on a thread of its own (storage/writer.py), where blocking is the point.
Through aiosqlite every statement made two more thread hops (the writer's loop -> aiosqlite's
worker thread -> back through the loop's self-pipe), each a GIL hand-off that waits up to the
interpreter's switch interval when the serving loop is busy: profiled under tagged traffic with
rewards flowing (issue 24), a reward's three statements cost ~3 ms of CPU, mostly those hand-offs.
Here a statement is a plain `sqlite3` call on the writer's thread, awaited as a coroutine that
never suspends, so `rows.py` keeps one async signature for SQLite and PostgreSQL alike.

Only what the writer calls exists: `connect`, `dispose` and `dialect` on the engine; `execute`,
`exec_driver_sql`, `driver` (a statement on the driver's connection itself), `begin` (an async
context manager), `execution_options`, `close` and `invalidate` on a connection.
Results are SQLAlchemy's own (`first`, `all`, `scalars`, ...).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from sqlalchemy import exc
from sqlalchemy.engine import Connection, Engine


class InlineEngine:
    """`engine`'s connections, awaited without leaving the calling thread."""

    def __init__(self, engine: Engine) -> None:
        self.sync_engine = engine
        self.dialect = engine.dialect
        self.url = engine.url

    async def connect(self) -> InlineConnection:
        return InlineConnection(self.sync_engine.connect())

    async def dispose(self) -> None:
        self.sync_engine.dispose()


class InlineConnection:
    """One connection of an `InlineEngine`."""

    def __init__(self, conn: Connection) -> None:
        self.sync_connection = conn
        self.dialect = conn.dialect

    async def execute(self, statement: Any, parameters: Any = None) -> Any:
        return self.sync_connection.execute(statement, parameters)

    async def exec_driver_sql(self, statement: str, parameters: Any = None) -> Any:
        return self.sync_connection.exec_driver_sql(statement, parameters)

    def driver(self, sql: str, parameters: tuple) -> Any:
        """`sql` on the driver's own connection, inside this connection's transaction; its cursor.
        No SQLAlchemy execution context (~45 us of Python a statement: `rows._Lite`); a driver error
        is raised as SQLAlchemy's, which the writer's retry rules read."""
        dbapi = self.dialect.loaded_dbapi
        try:
            return self.sync_connection.connection.dbapi_connection.execute(sql, parameters)
        except dbapi.Error as e:
            raise exc.DBAPIError.instance(sql, parameters, e, dbapi.Error) from e

    async def execution_options(self, **options: Any) -> InlineConnection:
        self.sync_connection.execution_options(**options)
        return self

    def begin(self) -> _Transaction:
        return _Transaction(self.sync_connection)

    async def close(self) -> None:
        self.sync_connection.close()

    async def invalidate(self) -> None:
        self.sync_connection.invalidate()


class _Transaction:
    """`async with conn.begin():` committed on a clean exit, rolled back on an error."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._tx: Any = None

    async def __aenter__(self) -> _Transaction:
        self._tx = self._conn.begin()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._tx.__exit__(kind, error, tb)
