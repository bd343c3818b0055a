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
from importlib import import_module

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import JSON, column

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_0016 = import_module("rlproxy.migrations.versions.0016_rollout_runs_apps_only")
_PINNED_JOINS = (
    "\n        AND NOT EXISTS (SELECT 1 FROM completions c WHERE c.run_id = r.id AND {pinned} LIKE '%@%')"
)
_VIEW = _0016._0013.rollout_runs_view(_0016.APPS_JOINS + _PINNED_JOINS, key_id=True)
_PINNED = {"sqlite": "json_extract(c.request, '$.model')", "postgresql": "(c.request::jsonb ->> 'model')"}


def upgrade() -> None:
    op.create_table(
        "keys",
        column("id", sa.String(length=32), "public id, key_<hex>", nullable=False),
        column("name", sa.String(length=128), "the operator's name for the app", nullable=False),
        column("secret_hash", sa.String(length=64), "sha256 hex of the secret (rk-...)", nullable=False),
        column("policies", JSON, "JSON list of policies it may use; NULL: all"),
        column("rpm", sa.Integer(), "requests per minute (NULL: no limit)"),
        column("tpm", sa.Integer(), "tokens per minute (NULL: no limit)"),
        column("max_streams", sa.Integer(), "streams in flight (NULL: no limit)"),
        column("scorer_url", sa.Text(), "its own scorer for siblings (NULL: none)"),
        column("created_at", sa.DateTime(timezone=True), nullable=False),
        column("revoked_at", sa.DateTime(timezone=True), "NULL: valid"),
        column(
            "last_used_at",
            sa.DateTime(timezone=True),
            "last request seen (updated once a minute at most per replica)",
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.add_column(
        "runs",
        column(
            "key_id", sa.String(length=32), "keys.id of the app that made it (NULL: the shared agents' key)"
        ),
    )
    op.create_index("ix_runs_key_id", "runs", ["key_id"])
    op.add_column(
        "completions",
        column(
            "key_id",
            sa.String(length=32),
            "keys.id of the app that made the call (NULL: the shared agents' key)",
        ),
    )
    op.execute("DROP VIEW IF EXISTS rollout_runs")
    op.execute(_VIEW.format(pinned=_PINNED[op.get_context().dialect.name]))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS rollout_runs")
    op.execute(_0016.APPS_VIEW)
    op.drop_column("completions", "key_id")
    op.drop_index("ix_runs_key_id", table_name="runs")
    op.drop_column("runs", "key_id")
    op.drop_table("keys")
