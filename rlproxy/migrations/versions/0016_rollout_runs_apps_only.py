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

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPS_VIEW = """
CREATE VIEW rollout_runs AS
SELECT rollout_id, policy,
    CASE WHEN step = candidate_step THEN 'candidate' ELSE 'incumbent' END AS arm,
    step, run_id, group_id, reward, status, errored, created_at, completed_at
FROM (
    SELECT ro.id AS rollout_id, ro.policy AS policy, ro.candidate_step AS candidate_step,
        ro.incumbent_step AS incumbent_step, r.id AS run_id, r.group_id AS group_id,
        r.reward AS reward, r.status AS status, r.created_at AS created_at,
        r.completed_at AS completed_at,
        (SELECT MIN(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS step,
        (SELECT MAX(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS last_step,
        CASE WHEN EXISTS (SELECT 1 FROM completions c WHERE c.run_id = r.id
            AND (c.status_code >= 500 OR c.finish_reason = 'length'
                OR CAST(c.response AS TEXT) LIKE '%<tool_call>%')) THEN 1 ELSE 0 END AS errored
    FROM rollouts ro
    JOIN runs r ON r.policy = ro.policy AND r.created_at >= ro.started_at
        AND (ro.decided_at IS NULL OR r.created_at < ro.decided_at)
        AND r.branch_of IS NULL
) AS a
WHERE step = last_step AND step IN (candidate_step, incumbent_step)
"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS rollout_runs")
    op.execute(APPS_VIEW)


def downgrade() -> None:
    from importlib import import_module  # a module name that starts with a digit

    op.execute("DROP VIEW IF EXISTS rollout_runs")
    op.execute(import_module("rlproxy.migrations.versions.0013_rollouts").ROLLOUT_RUNS_VIEW)
