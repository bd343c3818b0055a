"""A database file holding the storage tests' sample (tests/storage/storage_sample.py), for CLI tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "storage"))

from storage_sample import fill_sample, run_sync  # noqa: E402

from rlproxy.storage.db import create_engine, normalize_url, upgrade  # noqa: E402


def sample_db(path: Path) -> Path:
    """Migrate a new SQLite file at `path` and fill it with the sample rows; returns the path."""
    url = normalize_url(str(path))
    upgrade(url)

    async def fill() -> None:
        engine = create_engine(url)
        try:
            await fill_sample(engine)
        finally:
            await engine.dispose()

    run_sync(fill)
    return path
