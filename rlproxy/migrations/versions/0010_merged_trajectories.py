"""merged trajectories: segment and merge metrics (owner: issue 21)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

The trainer merges a run's calls token-exactly into segments (trainer/segments.py). Per step,
`training_steps` says how many positions it ran after merging and would have run without, and how
many calls broke the chain; per run, `runs.segments` and `runs.segment_breaks` say what became of
its calls and why it split (`SELECT id, segments, segment_breaks FROM runs WHERE segments > 1`).
Existing rows keep NULL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import add_column

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, name, type, comment): the comments are the models' (rlproxy/storage/models.py)
COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("training_steps", "positions_merged", "INTEGER",
     "token positions the step's forward passes ran (calls merged into segments)"),
    ("training_steps", "positions_unmerged", "INTEGER",
     "positions one sample per trained call would have run (prompt + completion)"),
    ("training_steps", "segment_breaks", "INTEGER",
     "calls that did not extend their run's earlier tokens: a new segment each"),
    ("runs", "segments", "INTEGER",
     "rows the trainer merged the run's calls into (1: every call extended the last)"),
    ("runs", "segment_breaks", "TEXT",
     'why the run split: JSON list of {"seq", "reason", "at", "of"} (NULL: no break)'),
)  # fmt: skip
TYPES = {"INTEGER": sa.Integer, "TEXT": sa.Text}


def upgrade() -> None:
    for table, name, type_, comment in COLUMNS:
        add_column(table, sa.Column(name, TYPES[type_](), comment=comment))


def downgrade() -> None:
    # Plain ALTER TABLE (SQLite >= 3.35): a batch copy of the table would trip over the views.
    for table, name, _, _ in reversed(COLUMNS):
        op.drop_column(table, name)
