"""keys per app: the `keys` table, `runs.key_id`, `completions.key_id`; canary arms an app cannot steer
(issue 55; docs/tenancy.md, docs/rollout.md)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07

- `keys`: one row per app key (`rlproxy keys create`): public `id` (key_<hex>), unique `name`, the
  sha256 of its secret (the secret itself is shown once and never stored), the policies it may use
  (JSON list, NULL: all), its limits (rpm, tpm, max_streams; NULL: none), its own `scorer_url`,
  `created_at`, `revoked_at` (NULL: valid), `last_used_at`.
- `runs.key_id`, `completions.key_id`: the key that made the run or the call (NULL: the shared
  agents' key, or no key). A keyed app's run and group ids are stored as `<key id>~<its id>`, so two
  apps never share a run or a group (proxy/keys.py).
- view `rollout_runs` again (0016's), now also without the runs that pinned a step (`"model":
  "policy@N"` in any call), as without sibling runs (`branch_of` NOT NULL); and with
  `key_id`, so the rule can cap one key's share of an arm (trainer/rollout_rule.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_VIEW = """
CREATE VIEW rollout_runs AS
SELECT rollout_id, policy,
    CASE WHEN step = candidate_step THEN 'candidate' ELSE 'incumbent' END AS arm,
    step, run_id, group_id, reward, status, errored, created_at, completed_at, key_id
FROM (
    SELECT ro.id AS rollout_id, ro.policy AS policy, ro.candidate_step AS candidate_step,
        ro.incumbent_step AS incumbent_step, r.id AS run_id, r.group_id AS group_id,
        r.reward AS reward, r.status AS status, r.created_at AS created_at,
        r.completed_at AS completed_at, r.key_id AS key_id,
        (SELECT MIN(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS step,
        (SELECT MAX(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS last_step,
        CASE WHEN EXISTS (SELECT 1 FROM completions c WHERE c.run_id = r.id
            AND (c.status_code >= 500 OR c.finish_reason = 'length'
                OR CAST(c.response AS TEXT) LIKE '%<tool_call>%')) THEN 1 ELSE 0 END AS errored
    FROM rollouts ro
    JOIN runs r ON r.policy = ro.policy AND r.created_at >= ro.started_at
        AND (ro.decided_at IS NULL OR r.created_at < ro.decided_at)
        AND r.branch_of IS NULL
        AND NOT EXISTS (SELECT 1 FROM completions c WHERE c.run_id = r.id AND {pinned} LIKE '%@%')
) AS a
WHERE step = last_step AND step IN (candidate_step, incumbent_step)
"""
_PINNED = {"sqlite": "json_extract(c.request, '$.model')", "postgresql": "(c.request::jsonb ->> 'model')"}


def upgrade() -> None:
    op.create_table(
        "keys",
        sa.Column("id", sa.String(length=32), nullable=False, comment="public id, key_<hex>"),
        sa.Column("name", sa.String(length=128), nullable=False, comment="the operator's name for the app"),
        sa.Column(
            "secret_hash", sa.String(length=64), nullable=False, comment="sha256 hex of the secret (rk-...)"
        ),
        sa.Column(
            "policies",
            sa.JSON(none_as_null=True),
            nullable=True,
            comment="JSON list of policies it may use; NULL: all",
        ),
        sa.Column("rpm", sa.Integer(), nullable=True, comment="requests per minute (NULL: no limit)"),
        sa.Column("tpm", sa.Integer(), nullable=True, comment="tokens per minute (NULL: no limit)"),
        sa.Column("max_streams", sa.Integer(), nullable=True, comment="streams in flight (NULL: no limit)"),
        sa.Column("scorer_url", sa.Text(), nullable=True, comment="its own scorer for siblings (NULL: none)"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True, comment="NULL: valid"),
        sa.Column(
            "last_used_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="last request seen (updated once a minute at most per replica)",
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.add_column(
        "runs",
        sa.Column(
            "key_id",
            sa.String(length=32),
            nullable=True,
            comment="keys.id of the app that made it (NULL: the shared agents' key)",
        ),
    )
    op.create_index("ix_runs_key_id", "runs", ["key_id"])
    op.add_column(
        "completions",
        sa.Column(
            "key_id",
            sa.String(length=32),
            nullable=True,
            comment="keys.id of the app that made the call (NULL: the shared agents' key)",
        ),
    )
    op.execute("DROP VIEW IF EXISTS rollout_runs")
    op.execute(_VIEW.format(pinned=_PINNED[op.get_context().dialect.name]))


def downgrade() -> None:
    from importlib import import_module

    op.execute("DROP VIEW IF EXISTS rollout_runs")
    op.execute(import_module("rlproxy.migrations.versions.0016_rollout_runs_apps_only").APPS_VIEW)
    op.drop_column("completions", "key_id")
    op.drop_index("ix_runs_key_id", table_name="runs")
    op.drop_column("runs", "key_id")
    op.drop_table("keys")
