"""canary rollouts: the `rollouts` table and the `rollout_runs` view (issue 28; docs/rollout.md)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01

- `rollouts`: one row per candidate step of a policy in `rollout = canary` mode (storage/models.py
  Rollout): candidate and incumbent step, fraction, status (canary -> promoted | rolled_back), the
  rule's last look (statistic, p-value, runs, reward and error rate per arm), decision, reason and
  times. UNIQUE (policy, candidate_step): one rollout, hence one decision, per candidate, whichever
  trainer, proxy or `rlproxy rollout` writes it.
- view `rollout_runs(rollout_id, policy, arm, step, run_id, group_id, reward, status, errored,
  created_at, completed_at)`: the runs of each rollout's arms. A run belongs to a rollout when it
  was created while the rollout was open and every completion of it was served by the candidate or
  by the incumbent (one step: runs that span a swap count for neither). `errored`: 1 when one of its
  completions got a 5xx, was cut at its length (finish_reason `length`) or holds a malformed tool
  call (a `<tool_call>` block the parser could not read stays in the content as text). Correlated MIN/MAX per
  run read only that run's completions (uq_completions_run_seq).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import column

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def rollout_runs_view(joins: str = "", key_id: bool = False) -> str:
    """The view's SQL; 0016 and 0017 re-create it with more `joins` conditions (0017 adds key_id)."""
    return f"""
CREATE VIEW rollout_runs AS
SELECT rollout_id, policy,
    CASE WHEN step = candidate_step THEN 'candidate' ELSE 'incumbent' END AS arm,
    step, run_id, group_id, reward, status, errored, created_at, completed_at{", key_id" * key_id}
FROM (
    SELECT ro.id AS rollout_id, ro.policy AS policy, ro.candidate_step AS candidate_step,
        ro.incumbent_step AS incumbent_step, r.id AS run_id, r.group_id AS group_id,
        r.reward AS reward, r.status AS status, r.created_at AS created_at,
        r.completed_at AS completed_at{", r.key_id AS key_id" * key_id},
        (SELECT MIN(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS step,
        (SELECT MAX(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS last_step,
        CASE WHEN EXISTS (SELECT 1 FROM completions c WHERE c.run_id = r.id
            AND (c.status_code >= 500 OR c.finish_reason = 'length'
                OR CAST(c.response AS TEXT) LIKE '%<tool_call>%')) THEN 1 ELSE 0 END AS errored
    FROM rollouts ro
    JOIN runs r ON r.policy = ro.policy AND r.created_at >= ro.started_at
        AND (ro.decided_at IS NULL OR r.created_at < ro.decided_at){joins}
) AS a
WHERE step = last_step AND step IN (candidate_step, incumbent_step)
"""


ROLLOUT_RUNS_VIEW = rollout_runs_view()


def upgrade() -> None:
    op.create_table(
        "rollouts",
        column("id", sa.Integer(), nullable=False, autoincrement=True),
        column("policy", sa.String(length=256), "the policy", nullable=False),
        column("candidate_step", sa.Integer(), "the new step on trial", nullable=False),
        column("incumbent_step", sa.Integer(), "the step it would replace (0 = base)", nullable=False),
        column("fraction", sa.Float(), "share of new runs the candidate serves, 0-1", nullable=False),
        column("status", sa.String(length=16), "canary, promoted or rolled_back", nullable=False),
        column("decision", sa.String(length=16), "the last look's outcome: continue, promote or rollback"),
        column("decided_by", sa.String(length=16), "rule, or manual (rlproxy rollout)"),
        column("reason", sa.Text(), "why, in words (the test and its numbers)"),
        column(
            "looks",
            sa.Integer(),
            "looks the rule took (each spends alpha / looks)",
            nullable=False,
            server_default="0",
        ),
        column("statistic", sa.String(length=16), "welch_t, paired_t or errors_z"),
        column("stat_value", sa.Float(), "the statistic at the last look"),
        column("p_value", sa.Float(), "its one-sided p-value"),
        column("candidate_runs", sa.Integer(), "rewarded runs of the candidate arm"),
        column("incumbent_runs", sa.Integer(), "rewarded runs of the incumbent arm"),
        column("candidate_reward", sa.Float(), "mean reward, candidate arm"),
        column("incumbent_reward", sa.Float(), "mean reward, incumbent arm"),
        column(
            "candidate_error_rate",
            sa.Float(),
            "share of the candidate's runs with a 5xx or a completion cut at its length",
        ),
        column("incumbent_error_rate", sa.Float(), "the same, incumbent arm"),
        column(
            "started_at", sa.DateTime(timezone=True), "runs created from then on are assigned", nullable=False
        ),
        column("looked_at", sa.DateTime(timezone=True), "the last look"),
        column("decided_at", sa.DateTime(timezone=True), "promoted or rolled back at"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("policy", "candidate_step", name="uq_rollouts_policy_candidate"),
    )
    op.create_index("ix_rollouts_policy_status", "rollouts", ["policy", "status"])
    op.execute(ROLLOUT_RUNS_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS rollout_runs")
    op.drop_index("ix_rollouts_policy_status", table_name="rollouts")
    op.drop_table("rollouts")
