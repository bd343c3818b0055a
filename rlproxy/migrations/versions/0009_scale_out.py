"""several writers on one PostgreSQL: `runs.next_seq`, the per-run counter that numbers completions

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

Several `serve` replicas may write completions of the same run at once (a load balancer sends any
request anywhere), so `seq` can no longer come from one process's memory. Each writer transaction
now upserts the run rows of its batch in run id order (`INSERT ... ON CONFLICT (id) DO UPDATE SET
next_seq = runs.next_seq + n RETURNING next_seq`): the update locks each run row until the commit,
so two writers number the same run one after the other, gapless, and a rolled-back transaction gives
its numbers back. The unique (run_id, seq) constraint of 0001 stays the safety net.

- `runs.next_seq` INTEGER NOT NULL DEFAULT 0: the `seq` the run's next completion gets; existing rows
  get max(seq) + 1 of their completions (0 when none).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import add_column, column

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COMMENT = "seq the run's next completion gets (the writers' counter, see storage/rows.py)"


def upgrade() -> None:
    add_column("runs", column("next_seq", sa.Integer(), COMMENT, nullable=False, server_default="0"))
    op.execute(
        "UPDATE runs SET next_seq = COALESCE("
        "(SELECT MAX(seq) + 1 FROM completions WHERE completions.run_id = runs.id), 0)"
    )


def downgrade() -> None:
    op.drop_column("runs", "next_seq")
