"""validation runs: runs.split, runs.status `validated`, training_steps.val_reward/val_runs, view `validation`

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

A run marked validation (header `X-Split: val` on its first request, or `"split": "val"` in its
reward body) is served and stored like any run but never trained: once rewarded its status becomes
`validated` (runs.status is a VARCHAR(16): the new value needs no DDL) instead of `completed`, so
no trainer query (they all start from `completed` or `ungrouped`) ever sees it.

- `runs.split` VARCHAR(8) NOT NULL DEFAULT 'train': `train` or `val`. Existing runs are `train`.
- `training_steps.val_reward` FLOAT, `training_steps.val_runs` INTEGER: when step N commits, the mean
  reward and the count of the rewarded val runs of its policy *served by step N-1* (every completion
  of the run has policy_step N-1; 0 = the base model), i.e. of the adapter step N started from,
  which is also what step N's `mean_reward` mostly measures (its runs were sampled by it).
  NULL / 0 when there was none. Frozen at the commit (val runs rewarded later are in the view).
- view `validation(policy, step, val_runs, val_reward)`: the same numbers, live, per adapter `step`
  that served the val runs (0 = base). Runs whose completions span two steps (served across a
  hot-swap) count for neither. The best checkpoint is its top row (storage/validation.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import add_column, column

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SPLIT_COMMENT = "train, or val: a validation run, served and stored but never trained"
# (name, type, comment): the comments are the models' (storage/models.py TrainingStep)
STEP_COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any], str], ...] = (
    ("val_reward", sa.Float(), "mean reward of the val runs served by step - 1 (at the commit)"),
    ("val_runs", sa.Integer(), "how many val runs val_reward averages"),
)

# One row per (policy, adapter step) with rewarded val runs. A correlated MIN/MAX per val run reads
# only that run's completions (uq_completions_run_seq), never all completions.
VALIDATION_VIEW = """
CREATE VIEW validation AS
SELECT policy, step, COUNT(*) AS val_runs, AVG(reward) AS val_reward
FROM (
    SELECT r.policy AS policy, r.reward AS reward,
        (SELECT MIN(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS step,
        (SELECT MAX(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS last_step
    FROM runs r
    WHERE r.status = 'validated' AND r.reward IS NOT NULL AND r.policy IS NOT NULL
) AS v
WHERE step IS NOT NULL AND step = last_step
GROUP BY policy, step
"""


def upgrade() -> None:
    split = column("split", sa.String(length=8), SPLIT_COMMENT, nullable=False, server_default="train")
    add_column("runs", split)
    for name, type_, comment in STEP_COLUMNS:
        add_column("training_steps", sa.Column(name, type_, comment=comment))
    op.execute(VALIDATION_VIEW)


def downgrade() -> None:
    # Plain ALTER TABLE (SQLite >= 3.35): a batch copy of the table would trip over the views.
    op.execute("DROP VIEW IF EXISTS validation")
    for name, *_ in reversed(STEP_COLUMNS):
        op.drop_column("training_steps", name)
    op.drop_column("runs", "split")
