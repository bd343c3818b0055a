"""Alembic: upgrade from empty, downgrade to base, upgrade again; the result matches the models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from storage_sample import run_sync

from rlproxy.storage import schema
from rlproxy.storage.db import MIGRATIONS_DIR, create_engine, downgrade, upgrade
from rlproxy.storage.models import Base

TABLES = {"runs", "completions", "training_steps"}
VIEWS = {"messages", "trajectories"}


async def _names(url: str) -> tuple[set[str], set[str]]:
    eng = create_engine(url)
    try:
        async with eng.connect() as conn:
            return await conn.run_sync(
                lambda c: (set(inspect(c).get_table_names()), set(inspect(c).get_view_names()))
            )
    finally:
        await eng.dispose()


async def _diffs(url: str) -> list:
    eng = create_engine(url)
    try:
        async with eng.connect() as conn:
            return await conn.run_sync(
                lambda c: compare_metadata(
                    MigrationContext.configure(c, opts={"compare_type": True}), Base.metadata
                )
            )
    finally:
        await eng.dispose()


async def test_upgrade_downgrade_upgrade(any_db_url: str) -> None:
    upgrade(any_db_url)
    tables, views = await _names(any_db_url)
    assert TABLES <= tables and VIEWS <= views
    downgrade(any_db_url)
    tables, views = await _names(any_db_url)
    assert not (tables - {"alembic_version"}) and not views
    upgrade(any_db_url)
    tables, views = await _names(any_db_url)
    assert TABLES <= tables and VIEWS <= views
    upgrade(any_db_url)  # at head already: a no-op, not an error


async def test_schema_matches_models(migrated_url: str) -> None:
    assert await _diffs(migrated_url) == []


def test_upgrade_works_outside_the_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rlproxy serve` migrates from wherever it is started: nothing may depend on the cwd."""
    monkeypatch.chdir(tmp_path)
    upgrade("here.db")  # a bare relative path, as a user would type it
    assert (tmp_path / "here.db").exists()
    assert MIGRATIONS_DIR.is_absolute()
    # What a wheel must carry (pyproject: packages rlproxy*, package-data *.mako/*.ini).
    for f in ("__init__.py", "env.py", "script.py.mako", "versions/__init__.py", "versions/0001_initial.py"):
        assert (MIGRATIONS_DIR / f).is_file(), f


def test_schema_sql_is_current() -> None:
    """docs/schema.sql is the migrations head; regenerate it when this fails:
    python -m rlproxy.storage.schema > docs/schema.sql"""
    assert (Path(__file__).parents[2] / "docs" / "schema.sql").read_text() == schema.head_schema()


def test_concurrent_upgrades(any_db_url: str) -> None:
    """`serve` and `train` starting together on a fresh database: one migrates, the others wait."""
    code = "import sys; from rlproxy.storage.db import upgrade; upgrade(sys.argv[1])"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, any_db_url], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    tables, views = run_sync(lambda: _names(any_db_url))
    assert TABLES <= tables and VIEWS <= views
