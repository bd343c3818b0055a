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
        column("id", sa.String(length=128), "the members' runs.group_id", nullable=False),
        column("completion_id", sa.Integer(), "the app's call it branched from", nullable=False),
        column("run_id", sa.String(length=128), "that call's run (NULL: untagged)"),
        column("policy", sa.String(length=256), "policy that sampled every member", nullable=False),
        column("policy_step", sa.Integer(), "step that sampled them (0 = base)"),
        column("k", sa.Integer(), "members, the app's answer included when with_original", nullable=False),
        column(
            "with_original",
            sa.Boolean(),
            "the app's answer is a member (false: its step was gone, K fresh answers)",
            nullable=False,
        ),
        column("reason", sa.String(length=16), "new, alone or plateau (settings.siblings)", nullable=False),
        column("temperature", sa.Float(), "sampling temperature of the siblings"),
        column("status", sa.String(length=16), "sampling, scoring, scored or failed", nullable=False),
        column("scorer", sa.String(length=32), "checks, url or judge (+checks)"),
        column("attempts", sa.Integer(), "scorer calls made so far", nullable=False, server_default="0"),
        column("error", sa.Text(), "why it failed (the last scorer error)"),
        column("sampled_tokens", sa.Integer(), "tokens the siblings sampled"),
        column("sample_ms", sa.Float(), "engine wall time of the siblings, ms"),
        column("created_at", sa.DateTime(timezone=True), nullable=False),
        column("scored_at", sa.DateTime(timezone=True)),
        sa.ForeignKeyConstraint(["completion_id"], ["completions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("completion_id", name="uq_sibling_groups_completion"),
    )
    op.create_index("ix_sibling_groups_status", "sibling_groups", ["status", "created_at"])
    op.create_table(
        "shadow_checks",
        column("id", sa.Integer(), nullable=False, autoincrement=True),
        column("policy", sa.String(length=256), nullable=False),
        column("candidate_step", sa.Integer(), "the new step", nullable=False),
        column("serving_step", sa.Integer(), "the step serving when it ran (0 = base)", nullable=False),
        column(
            "status", sa.String(length=16), "running, passed, failed (rolled back) or error", nullable=False
        ),
        column("prompts", sa.Integer(), "prompt pairs scored"),
        column("candidate_score", sa.Float(), "mean score of the candidate"),
        column("serving_score", sa.Float(), "mean score of the serving step"),
        column("margin", sa.Float(), "shadow_margin in force"),
        column("scorer", sa.String(length=32)),
        column("pairs", sa.JSON(), 'JSON list of {"completion_id", "candidate", "serving"} scores'),
        column("reason", sa.Text(), "the decision in words"),
        column("created_at", sa.DateTime(timezone=True), nullable=False),
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
