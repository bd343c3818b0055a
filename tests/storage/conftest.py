"""Storage fixtures: every test runs on SQLite and on PostgreSQL, each on a fresh database.

PostgreSQL is the session's server (`pg_server_url` in tests/conftest.py: RLPROXY_TEST_PG_URL, or a
throwaway server from the `pgserver` wheel); each test gets its own database, created from that
server and dropped after.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine
from storage_sample import fill_sample, run_sync

from rlproxy.storage.db import create_engine, upgrade


async def _pg_admin(base: str, sql: str) -> None:
    import asyncpg

    u = make_url(base)
    conn = await asyncpg.connect(
        host=u.host, port=u.port or 5432, user=u.username, password=u.password, database=u.database
    )
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _create_db(base: str, migrate: bool) -> str:
    name = f"rlproxy_t_{uuid.uuid4().hex[:12]}"
    run_sync(lambda: _pg_admin(base, f'CREATE DATABASE "{name}"'))
    url = make_url(base).set(database=name).render_as_string(hide_password=False)
    if migrate:
        upgrade(url)
    return url


def _drop_db(base: str, url: str) -> None:
    name = make_url(url).database
    run_sync(lambda: _pg_admin(base, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database (dropped after the test)."""
    base = pg_server_url
    url = _create_db(base, migrate=False)
    try:
        yield url
    finally:
        _drop_db(base, url)


@pytest.fixture(scope="session")
def _pg_shared(pg_server_url: str) -> Iterator[str]:
    """One migrated PostgreSQL database for the session (cheaper than migrating one per test)."""
    base = pg_server_url
    url = _create_db(base, migrate=True)
    try:
        yield url
    finally:
        _drop_db(base, url)


@pytest.fixture
def pg_migrated_url(_pg_shared: str) -> str:
    """The session's migrated PostgreSQL database, emptied: as fresh as a new one for every test."""
    # rollouts too: a rolled-back step of an earlier test hides that step from latest_adapters
    tables = "runs, completions, training_steps, rollouts, shadow_checks"
    run_sync(lambda: _pg_admin(_pg_shared, f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    return _pg_shared


@pytest.fixture(params=["sqlite", "postgresql"])
def db_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def any_db_url(db_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of each kind (not migrated)."""
    if db_kind == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def migrated_url(db_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database of each kind at the migrations head, holding no rows."""
    if db_kind == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}"
        upgrade(url)
        return url
    return request.getfixturevalue("pg_migrated_url")


@pytest.fixture
async def engine(migrated_url: str) -> AsyncIterator[AsyncEngine]:
    """A read-write engine on a migrated database of each kind."""
    eng = create_engine(migrated_url)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def sample_engine(engine: AsyncEngine) -> AsyncEngine:
    """`engine` on a database holding the sample rows."""
    await fill_sample(engine)
    return engine
