"""training_steps: one column per headline metric of a step, so `SELECT kl, clip_frac_high ...` just works

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

The numbers were only in the `metrics` JSON (still filled: it keeps every namespaced metric);
these columns are the ones people plot and `rlproxy steps` prints. `kind` says what made the step:
`grpo` (every step so far, hence the default) or, later, `sft`. Existing rows keep NULL metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import add_column, column

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, comment): the comments are the models' (rlproxy/storage/models.py TrainingStep)
FLOAT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("reward_std", "std of the step's run rewards"),
    ("zero_variance_frac", "groups with equal rewards / groups seen since the last step (skipped too)"),
    ("kl", "per token: k3 to the base when beta > 0, else approx KL to the sampler"),
    ("clip_frac_low", "fraction of tokens clipped at 1 - epsilon (A < 0)"),
    ("clip_frac_high", "fraction of tokens clipped at 1 + epsilon_high (A > 0)"),
    ("entropy", "mean entropy of the policy at the sampled positions, nats"),
    ("completion_len_mean", "mean sampled tokens per trained completion"),
    ("policy_lag_mean", "mean adapter steps between sampling and training"),
    ("tokens_per_s", "prompt + completion tokens trained per second"),
    ("grad_norm", "global gradient norm before clipping"),
)
KIND_COMMENT = "grpo, or sft for supervised steps"


def upgrade() -> None:
    for name, comment in FLOAT_COLUMNS:
        add_column("training_steps", sa.Column(name, sa.Float(), comment=comment))
    kind = column("kind", sa.String(length=16), KIND_COMMENT, nullable=False, server_default="grpo")
    add_column("training_steps", kind)


def downgrade() -> None:
    # Plain ALTER TABLE (SQLite >= 3.35): a batch copy of the table would trip over the views.
    for name in ("kind", *(n for n, _ in reversed(FLOAT_COLUMNS))):
        op.drop_column("training_steps", name)
