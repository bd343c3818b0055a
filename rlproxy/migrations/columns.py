"""`add_column`: Alembic's, but SQLite's ALTER TABLE keeps the column's comment in its stored DDL.

CREATE TABLE keeps comments on SQLite (storage/db.py compiles them in), so `sqlite3 rlproxy.db
.schema` documents every column; Alembic's own ADD COLUMN would drop them.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.schema import CreateColumn


def add_column(table: str, column: sa.Column[Any]) -> None:
    """Add `column` to `table`, its comment kept in SQLite's DDL text."""
    if op.get_context().dialect.name != "sqlite":
        op.add_column(table, column)
        return
    op.execute(
        f"ALTER TABLE {table} ADD COLUMN {CreateColumn(column).compile(dialect=op.get_bind().dialect)}"
    )
