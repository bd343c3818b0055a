"""live traffic: runs.status `ungrouped`, runs.status_reason, and an index for the trainer's poll

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

Live traffic rarely repeats a task, so most runs are alone in their group. The trainer now moves a
rewarded run that is still alone in its (policy, group_id) `group_timeout` seconds after its reward
from `completed` to the new status `ungrouped` (runs.status is a VARCHAR(16): the new value needs no
DDL), instead of leaving it `completed` forever. With `singletons=train` it later trains such runs in
batches against the batch's mean reward (then they become `trained`, and keep their reason).

- `runs.status_reason` VARCHAR(32), NULL: why the trainer gave a run its status, one code:
  `no_sibling` (ungrouped: no other rewarded run of its group within group_timeout),
  `zero_variance` (skipped: its group's or batch's rewards were all equal),
  `stale` (skipped: every sample older than max_policy_lag), `no_usable_completion` (failed:
  nothing sampled was stored), `nonfinite` (failed: its steps' loss or gradient was not finite 3 times).
  Existing rows keep NULL.
- `ix_runs_status_completed (status, completed_at, id)`: the poll reads the runs of one status oldest
  first through it (completed runs past group_timeout, the oldest ungrouped batch), so its cost does
  not grow with the number of ungrouped, trained or skipped runs.

No data is moved: existing lone `completed` runs become `ungrouped` at the trainer's first poll
(`group_timeout` is a setting, not something a migration knows).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import add_column

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COMMENT = (
    "why the trainer set its status: no_sibling, zero_variance, stale, no_usable_completion, "
    "nonfinite (see storage/training.py)"
)


def upgrade() -> None:
    add_column("runs", sa.Column("status_reason", sa.String(length=32), comment=COMMENT))
    op.create_index("ix_runs_status_completed", "runs", ["status", "completed_at", "id"])


def downgrade() -> None:
    # Plain ALTER TABLE (SQLite >= 3.35): a batch copy of the table would trip over the views.
    op.drop_index("ix_runs_status_completed", table_name="runs")
    op.drop_column("runs", "status_reason")
