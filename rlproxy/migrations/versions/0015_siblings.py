"""siblings, shadow check: `sibling_groups`, `shadow_checks`, `runs.branch_of` (issue 54; docs/siblings.md)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07

- `sibling_groups`: one row per stored call the proxy branched (storage/models.py SiblingGroup): the
  call, its run, the policy step that sampled, K, why it was chosen (new, alone, plateau), the
  temperature, status (sampling -> scoring -> scored | failed), the scorer, its attempts and last
  error, and what the siblings cost (tokens, engine ms). UNIQUE (completion_id): a call branches once.
- `runs.branch_of`: a member run of a sibling group names the call it answers again; its one
  completion holds the exact prompt ids, sampled ids and logprobs; `group_id` is the sibling group.
- `shadow_checks`: one row per candidate step checked against the serving step on stored prompts
  before it serves anyone (ShadowCheck); UNIQUE (policy, candidate_step).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import column

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "runs",
        column(
            "branch_of", sa.Integer(), "completions.id this sibling run answers again (NULL: an app's run)"
        ),
    )
    op.create_table(
        "sibling_groups",
        sa.Column("id", sa.String(length=128), nullable=False, comment="the members' runs.group_id"),
        sa.Column("completion_id", sa.Integer(), nullable=False, comment="the app's call it branched from"),
        column("run_id", sa.String(length=128), "that call's run (NULL: untagged)"),
        sa.Column(
            "policy", sa.String(length=256), nullable=False, comment="policy that sampled every member"
        ),
        column("policy_step", sa.Integer(), "step that sampled them (0 = base)"),
        sa.Column(
            "k", sa.Integer(), nullable=False, comment="members, the app's answer included when with_original"
        ),
        sa.Column(
            "with_original",
            sa.Boolean(),
            nullable=False,
            comment="the app's answer is a member (false: its step was gone, K fresh answers)",
        ),
        sa.Column(
            "reason",
            sa.String(length=16),
            nullable=False,
            comment="new, alone or plateau (settings.siblings)",
        ),
        column("temperature", sa.Float(), "sampling temperature of the siblings"),
        sa.Column(
            "status", sa.String(length=16), nullable=False, comment="sampling, scoring, scored or failed"
        ),
        column("scorer", sa.String(length=32), "checks, url or judge (+checks)"),
        sa.Column(
            "attempts", sa.Integer(), server_default="0", nullable=False, comment="scorer calls made so far"
        ),
        column("error", sa.Text(), "why it failed (the last scorer error)"),
        column("sampled_tokens", sa.Integer(), "tokens the siblings sampled"),
        column("sample_ms", sa.Float(), "engine wall time of the siblings, ms"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        column("scored_at", sa.DateTime(timezone=True)),
        sa.ForeignKeyConstraint(["completion_id"], ["completions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("completion_id", name="uq_sibling_groups_completion"),
    )
    op.create_index("ix_sibling_groups_status", "sibling_groups", ["status", "created_at"])
    op.create_table(
        "shadow_checks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("policy", sa.String(length=256), nullable=False),
        sa.Column("candidate_step", sa.Integer(), nullable=False, comment="the new step"),
        sa.Column(
            "serving_step", sa.Integer(), nullable=False, comment="the step serving when it ran (0 = base)"
        ),
        sa.Column(
            "status",
            sa.String(length=16),
            nullable=False,
            comment="running, passed, failed (rolled back) or error",
        ),
        column("prompts", sa.Integer(), "prompt pairs scored"),
        column("candidate_score", sa.Float(), "mean score of the candidate"),
        column("serving_score", sa.Float(), "mean score of the serving step"),
        column("margin", sa.Float(), "shadow_margin in force"),
        column("scorer", sa.String(length=32)),
        column("pairs", sa.JSON(), 'JSON list of {"completion_id", "candidate", "serving"} scores'),
        column("reason", sa.Text(), "the decision in words"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        column("finished_at", sa.DateTime(timezone=True)),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("policy", "candidate_step", name="uq_shadow_checks_candidate"),
    )


def downgrade() -> None:
    op.drop_table("shadow_checks")
    op.drop_index("ix_sibling_groups_status", table_name="sibling_groups")
    op.drop_table("sibling_groups")
    # Plain ALTER TABLE (SQLite >= 3.35): a batch copy of the table would trip over the views.
    op.drop_column("runs", "branch_of")
