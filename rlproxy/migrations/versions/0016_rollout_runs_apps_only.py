"""siblings are not app runs: the `rollout_runs` view leaves out runs with `branch_of` set (issue 54)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07

A sibling group's members (storage/siblings.py) are `runs` rows of the policy, created while a
rollout may be open and sampled by one step: without this they would count as canary runs, scored
by a scorer rather than rewarded by the app. The view is 0013's but for `r.branch_of IS NULL`.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import import_module

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_0013 = import_module("rlproxy.migrations.versions.0013_rollouts")  # a module name that starts with a digit

APPS_JOINS = "\n        AND r.branch_of IS NULL"
APPS_VIEW = _0013.rollout_runs_view(APPS_JOINS)


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS rollout_runs")
    op.execute(APPS_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS rollout_runs")
    op.execute(_0013.ROLLOUT_RUNS_VIEW)
