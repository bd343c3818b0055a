"""completions.capture_id: the unique id of each captured record, so a crash-journal replay is idempotent

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

The proxy appends every completion to a local journal before the client gets its last byte and
replays the journal on start; a record both committed and still in the journal must not be stored
twice. Existing rows keep NULL (a unique index allows many NULLs on SQLite and PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import add_column

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


COMMENT = "unique id the proxy gave the record (its crash-journal replay stores it once)"


def upgrade() -> None:
    add_column("completions", sa.Column("capture_id", sa.String(length=64), comment=COMMENT))
    op.create_index("ux_completions_capture_id", "completions", ["capture_id"], unique=True)


def downgrade() -> None:
    # Plain ALTER TABLE (SQLite >= 3.35): a batch copy of the table would trip over the views.
    op.drop_index("ux_completions_capture_id", table_name="completions")
    op.drop_column("completions", "capture_id")
