"""Engines: URL normalization, SQLite's pragmas, and read-only engines the database enforces."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from rlproxy.storage.db import create_engine, normalize_url, sqlite_path, upgrade


def test_normalize_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    here = tmp_path.resolve()
    assert normalize_url("rlproxy.db") == f"sqlite+aiosqlite:///{here / 'rlproxy.db'}"
    assert normalize_url("./a/b.db") == f"sqlite+aiosqlite:///{here / 'a' / 'b.db'}"
    assert normalize_url("sqlite:///x.db") == f"sqlite+aiosqlite:///{here / 'x.db'}"
    assert normalize_url("sqlite+aiosqlite:////abs/x.db") == "sqlite+aiosqlite:////abs/x.db"
    assert normalize_url(":memory:") == "sqlite+aiosqlite://"
    assert normalize_url("postgres://u:p@h/db") == "postgresql+asyncpg://u:p@h/db"
    assert normalize_url("postgresql://u@h:5433/db") == "postgresql+asyncpg://u@h:5433/db"
    assert normalize_url("postgresql+psycopg://u@h/db") == "postgresql+asyncpg://u@h/db"
    assert normalize_url("postgresql+asyncpg://u@h/db") == "postgresql+asyncpg://u@h/db"
    assert sqlite_path(normalize_url("/a b/c#d?e/f%20.db")) == "/a b/c#d?e/f%20.db"


async def test_any_file_name_works(tmp_path: Path) -> None:
    """Paths are paths: `?`, `#`, `%` and spaces reach SQLite intact, read-write and read-only."""
    path = tmp_path / "we ird#dir?x" / "a%20b.db"
    upgrade(str(path))
    assert path.exists()
    for readonly in (False, True):
        eng = create_engine(str(path), readonly=readonly)
        try:
            async with eng.connect() as conn:
                assert (await conn.execute(text("SELECT count(*) FROM runs"))).scalar() == 0
        finally:
            await eng.dispose()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["we ird#dir?x"]


async def test_statement_timeout(migrated_url: str) -> None:
    """Users' ad-hoc queries can be time-limited; the connection stays usable after."""
    slow = (
        "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r"
        if migrated_url.startswith("sqlite")
        else "SELECT pg_sleep(10)"
    )
    eng = create_engine(migrated_url, readonly=True, statement_timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(DBAPIError):
            async with eng.connect() as conn:
                await conn.exec_driver_sql(slow)
        assert time.monotonic() - t0 < 5
        async with eng.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM runs"))).scalar() == 0
    finally:
        await eng.dispose()


async def test_sqlite_pragmas(db_url: str) -> None:
    upgrade(db_url)
    eng = create_engine(db_url)
    try:
        async with eng.connect() as conn:
            got = {
                p: (await conn.exec_driver_sql(f"PRAGMA {p}")).scalar()
                for p in ("journal_mode", "busy_timeout", "foreign_keys", "synchronous")
            }
    finally:
        await eng.dispose()
    assert got["journal_mode"] == "wal"
    assert got["busy_timeout"] >= 5000
    assert got["foreign_keys"] == 1
    assert got["synchronous"] == 1  # NORMAL


WRITES_ANY = [
    "INSERT INTO runs (id, status, created_at) VALUES ('x', 'open', CURRENT_TIMESTAMP)",
    "DELETE FROM runs",
    "UPDATE runs SET reward = 1",
    "CREATE TABLE t (a INTEGER)",
]
WRITES_SQLITE = [
    "ATTACH DATABASE '{tmp}/other.db' AS other",
    "ATTACH DATABASE ':memory:' AS other",
    "PRAGMA user_version = 7",
    "PRAGMA journal_mode = DELETE",
]


async def test_readonly_engine_refuses_writes(migrated_url: str, tmp_path: Path) -> None:
    rw = create_engine(migrated_url)
    async with rw.begin() as conn:
        await conn.execute(
            text("INSERT INTO runs (id, status, created_at) VALUES ('r1', 'open', CURRENT_TIMESTAMP)")
        )
    await rw.dispose()

    sqlite = migrated_url.startswith("sqlite")
    ro = create_engine(migrated_url, readonly=True)
    try:
        statements = WRITES_ANY + ([s.format(tmp=tmp_path) for s in WRITES_SQLITE] if sqlite else [])
        for sql in statements:
            with pytest.raises(DBAPIError):
                async with ro.connect() as conn:
                    await conn.exec_driver_sql(sql)
                    await conn.commit()
        if not sqlite:  # turning the setting off inside the session does not make it writable
            with pytest.raises(DBAPIError):
                async with ro.connect() as conn:
                    await conn.exec_driver_sql("SET default_transaction_read_only = off")
                    await conn.exec_driver_sql(WRITES_ANY[0])
                    await conn.commit()
        async with ro.connect() as conn:  # reads work, and nothing was changed
            assert (await conn.execute(text("SELECT id, reward FROM runs"))).all() == [("r1", None)]
            if sqlite:
                assert (await conn.exec_driver_sql("PRAGMA user_version")).scalar() == 0
                assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
    finally:
        await ro.dispose()
    assert not (tmp_path / "other.db").exists()


def test_readonly_needs_an_existing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        create_engine(str(tmp_path / "missing.db"), readonly=True)


async def test_a_store_deleted_under_an_engine_is_not_made_again(tmp_path: Path) -> None:
    """A connection opened after the file was deleted (a pool growing, the writer's own engine, a
    writer process restarted) fails; it does not make an empty store at the path, which the writer
    would then fill while /healthz reports the file replaced rather than missing (issue 22, case 8)."""
    from rlproxy.storage.db import writer_engine

    path = tmp_path / "we ird#dir?x" / "a%20b.db"
    upgrade(str(path))
    eng = create_engine(str(path))
    sync = writer_engine(eng)
    try:
        async with eng.begin() as conn:  # read-write while the file is there
            await conn.execute(text("INSERT INTO runs (id, status, created_at) VALUES ('a', 'open', '2026')"))
        await eng.dispose()
        path.unlink()
        with pytest.raises(DBAPIError, match="unable to open database file"):
            async with eng.connect() as conn:
                await conn.execute(text("SELECT 1"))
        with pytest.raises(DBAPIError, match="unable to open database file"):
            await (await sync.connect()).execute(text("SELECT 1"))
        assert not path.exists()
    finally:
        await eng.dispose()
        await sync.dispose()
    fresh = create_engine(str(tmp_path / "new.db"))  # a file not there yet is created, as ever
    try:
        async with fresh.begin() as conn:
            await conn.execute(text("CREATE TABLE t (x)"))
    finally:
        await fresh.dispose()
    assert (tmp_path / "new.db").exists()
