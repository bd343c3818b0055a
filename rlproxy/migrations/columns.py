"""What the migrations share: `add_column` (Alembic's, but SQLite's ALTER TABLE keeps the column's
comment in its stored DDL) and `column`, a column with its comment, nullable unless told.

CREATE TABLE keeps comments on SQLite (storage/db.py compiles them in), so `sqlite3 rlproxy.db
.schema` documents every column; Alembic's own ADD COLUMN would drop them. `column(...)` is
`sa.Column(name, type, nullable=..., comment=...)`: the DDL is the same text.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.schema import CreateColumn

JSON = sa.JSON(none_as_null=True)  # a missing value is SQL NULL, as the models' JSON columns


def column(
    name: str, type_: Any, comment: str | None = None, nullable: bool = True, **kw: Any
) -> sa.Column[Any]:
    """`sa.Column(name, type_, nullable=nullable, comment=comment, **kw)`: nullable unless told."""
    return sa.Column(name, type_, nullable=nullable, comment=comment, **kw)


def add_column(table: str, column: sa.Column[Any]) -> None:
    """Add `column` to `table`, its comment kept in SQLite's DDL text."""
    if op.get_context().dialect.name != "sqlite":
        op.add_column(table, column)
        return
    op.execute(
        f"ALTER TABLE {table} ADD COLUMN {CreateColumn(column).compile(dialect=op.get_bind().dialect)}"
    )
