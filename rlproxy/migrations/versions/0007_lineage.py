"""lineage: the `policies` table, saying how a policy started (a fork of another's step, or a LoRA folder)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

A policy that starts from a fresh adapter (the default) has no row here: its step 1 is its first
GRPO (or SFT) step. A policy started by `rlproxy fork POLICY@N NEW` or `--init-adapter DIR` gets a row
and, in the same transaction, its step 1: a `training_steps` row whose `kind` is `fork` or `init`
(`training_steps.kind` is a VARCHAR(16): the new values need no DDL; `sft` marks supervised steps),
whose adapter is a copy of the starting LoRA in `checkpoints/{policy}/step-0001/`, and that trained
no runs. So `NEW@1` serves exactly the forked adapter, and the new policy's next steps are 2, 3, ...

- `policies.name` VARCHAR(256) primary key: the policy (`runs.policy`, `training_steps.policy`).
- `policies.parent`, `policies.parent_step`: the step it was forked from (NULL: not a fork).
- `policies.init_adapter`: the LoRA folder it started from (`--init-adapter`; NULL for a fork).
- `policies.created_at`: when it started.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import column

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "policies",
        column("name", sa.String(length=256), "the policy", nullable=False),
        column("parent", sa.String(length=256), "policy it was forked from"),
        column("parent_step", sa.Integer(), "step of parent it was forked from"),
        column("init_adapter", sa.Text(), "LoRA folder it started from (--init-adapter)"),
        column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("policies")
