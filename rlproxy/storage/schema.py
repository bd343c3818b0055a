"""The SQLite schema at the migrations head, for people to read: docs/schema.sql is its output.

Nothing reads that file at run time. Regenerate it after adding a migration (a test fails while
it is stale):

    python -m rlproxy.storage.schema > docs/schema.sql
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
from pathlib import Path

from rlproxy.storage.db import upgrade

HEADER = """\
-- rlproxy's SQLite schema at the newest migration (generated: python -m rlproxy.storage.schema).
-- Do not edit: change rlproxy/storage/models.py, add an Alembic revision, regenerate this file.
-- JSON columns hold JSON text: query them with json_extract(col, '$.path') and json_each(col).
-- Views: messages (one row per chat message of each completion), trajectories (one row per run),
-- validation (mean reward of the validation runs per policy and adapter step).
"""
_ORDER = {"table": 0, "index": 1, "view": 2, "trigger": 3}


def dump_sqlite_schema(db_path: str | Path) -> str:
    """The CREATE statements of a SQLite database, tables then indexes then views, by name."""
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
    finally:
        con.close()
    rows.sort(key=lambda r: (_ORDER.get(r[0], 9), r[1]))
    body = "".join(f"\n{sql.strip()};\n" for _type, _name, sql in rows)
    return HEADER + "\n".join(line.rstrip() for line in body.split("\n"))


def head_schema() -> str:
    """The schema a fresh database gets from the migrations (migrated in a temporary folder)."""
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "schema.db"
        upgrade(str(db))
        return dump_sqlite_schema(db)


def main() -> None:
    sys.stdout.write(head_schema())


if __name__ == "__main__":
    main()
