"""Alembic environment: runs the revisions on rlproxy's own async engine (same pragmas as the app).

Configured in code by `rlproxy.storage.db.alembic_config`, so no alembic.ini is needed at run time;
`rlproxy/migrations/alembic.ini` exists for developers who want the `alembic` command itself.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from rlproxy.storage.db import SQLITE_BEGIN, create_engine
from rlproxy.storage.models import Base

MIGRATION_LOCK = 0x726C7072  # "rlpr": the advisory lock PostgreSQL migrations serialize on
config = context.config
target_metadata = Base.metadata


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things: future revisions copy-and-move
        compare_type=True,
        **kwargs,
    )


def run_offline() -> None:
    """`alembic upgrade --sql`: print the SQL instead of running it."""
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        # Two processes may start on one fresh database at once (`serve` and `train`): the second
        # waits here for the first to finish, then finds the schema at head and does nothing.
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            if conn.dialect.name == "sqlite":  # take the write lock at BEGIN, before reading the version
                conn = await conn.execution_options(**{SQLITE_BEGIN: "IMMEDIATE"})
            await conn.run_sync(_run_sync)
            await conn.commit()
    finally:
        await engine.dispose()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_sync(connection)
    else:
        asyncio.run(_run_async(config.get_main_option("sqlalchemy.url")))


if context.is_offline_mode():
    run_offline()
else:
    run_online()
