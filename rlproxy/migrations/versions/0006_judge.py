"""judge rewards: where a run's reward came from, the judge's explanation, a per-run rubric

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

A run may now be completed without a number (`POST /v1/runs/{id}/complete`, or a reward body
`{"judge": true}`): it becomes `completed` with `reward` NULL and `reward_source` 'judge' until the
judge (rlproxy/trainer/judge.py) scores its group, which sets `reward` and `judge_explanation` in
one transaction. A judge that keeps answering malformed JSON marks the group `failed` with
status_reason `judge_failed` (runs.status_reason is a VARCHAR(32): the new code needs no DDL).

- `runs.reward_source` VARCHAR(16), NULL: `app` (posted by the app) or `judge` (scored, or waiting
  for the judge while `reward` is NULL). Existing rewarded rows are set to `app`.
- `runs.judge_explanation` TEXT, NULL: the judge's short reason for the score.
- `runs.judge_rubric` TEXT, NULL: the rubric the complete request named (NULL: the policy's or the
  built-in one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import add_column

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, type, comment): the comments are the models' (storage/models.py Run)
COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any], str], ...] = (
    ("reward_source", sa.String(length=16), "app or judge (NULL reward: waiting for the judge)"),
    ("judge_explanation", sa.Text(), "the judge's short reason for its score"),
    ("judge_rubric", sa.Text(), "rubric named when the run was completed (NULL: the policy's)"),
)


def upgrade() -> None:
    for name, type_, comment in COLUMNS:
        add_column("runs", sa.Column(name, type_, comment=comment))
    op.execute("UPDATE runs SET reward_source = 'app' WHERE reward IS NOT NULL")


def downgrade() -> None:
    # Plain ALTER TABLE (SQLite >= 3.35): a batch copy of the table would trip over the views.
    for name, *_ in reversed(COLUMNS):
        op.drop_column("runs", name)
