"""initial schema: runs, completions, training_steps and the views messages, trajectories

Revision ID: 0001
Revises:
Create Date: 2026-11-29

The views are written twice, once per dialect: SQLite with json_each/json_extract (so that the
plain `sqlite3` command line can read them), PostgreSQL with the jsonb functions. Both give the
same columns and rows:

  messages(run_id, completion_id, seq, idx, role, content, tool_calls, name)
      one row per message of each chat completion: the request's messages at idx 0..k-1, then
      the assistant's reply (the first choice's message) at idx k. `content` is the text, or the
      JSON text of a list of content parts; `tool_calls` is JSON.
  trajectories(run_id, group_id, reward, status, n_completions, messages)
      one row per run; `messages` is a JSON array: the run's last completion's request messages
      followed by its reply, i.e. the whole conversation as the model last saw and continued it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import JSON, column

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


SQLITE_MESSAGES = """
CREATE VIEW messages AS
SELECT c.run_id AS run_id, c.id AS completion_id, c.seq AS seq, CAST(m.key AS INTEGER) AS idx,
       json_extract(m.value, '$.role') AS role,
       json_extract(m.value, '$.content') AS content,
       json_extract(m.value, '$.tool_calls') AS tool_calls,
       json_extract(m.value, '$.name') AS name
FROM completions AS c, json_each(c.request, '$.messages') AS m
WHERE json_type(c.request, '$.messages') = 'array'
UNION ALL
SELECT c.run_id, c.id, c.seq,
       coalesce(json_array_length(c.request, '$.messages'), 0),
       coalesce(json_extract(c.response, '$.choices[0].message.role'), 'assistant'),
       json_extract(c.response, '$.choices[0].message.content'),
       json_extract(c.response, '$.choices[0].message.tool_calls'),
       json_extract(c.response, '$.choices[0].message.name')
FROM completions AS c
WHERE json_type(c.response, '$.choices[0].message') = 'object'
"""

SQLITE_TRAJECTORIES = """
CREATE VIEW trajectories AS
SELECT r.id AS run_id, r.group_id AS group_id, r.reward AS reward, r.status AS status,
       (SELECT count(*) FROM completions AS c WHERE c.run_id = r.id) AS n_completions,
       (SELECT CASE
                 WHEN json_type(c.response, '$.choices[0].message') = 'object'
                 THEN json_insert(coalesce(json_extract(c.request, '$.messages'), '[]'), '$[#]',
                                  json(json_extract(c.response, '$.choices[0].message')))
                 ELSE coalesce(json_extract(c.request, '$.messages'), '[]')
               END
        FROM completions AS c WHERE c.run_id = r.id ORDER BY c.seq DESC LIMIT 1) AS messages
FROM runs AS r
"""

# PostgreSQL: the JSON columns are `json`; cast to jsonb to use its operators.
PG_MESSAGES = """
CREATE VIEW messages AS
SELECT c.run_id AS run_id, c.id AS completion_id, c.seq AS seq, (m.ord - 1)::integer AS idx,
       m.value ->> 'role' AS role,
       m.value ->> 'content' AS content,
       nullif(m.value -> 'tool_calls', 'null'::jsonb) AS tool_calls,
       m.value ->> 'name' AS name
FROM completions AS c
CROSS JOIN LATERAL jsonb_array_elements(
    CASE WHEN jsonb_typeof(c.request::jsonb -> 'messages') = 'array'
         THEN c.request::jsonb -> 'messages' ELSE '[]'::jsonb END
) WITH ORDINALITY AS m(value, ord)
UNION ALL
SELECT c.run_id, c.id, c.seq,
       coalesce(jsonb_array_length(CASE WHEN jsonb_typeof(c.request::jsonb -> 'messages') = 'array'
                                        THEN c.request::jsonb -> 'messages' END), 0),
       coalesce(c.response::jsonb #>> '{choices,0,message,role}', 'assistant'),
       c.response::jsonb #>> '{choices,0,message,content}',
       nullif(c.response::jsonb #> '{choices,0,message,tool_calls}', 'null'::jsonb),
       c.response::jsonb #>> '{choices,0,message,name}'
FROM completions AS c
WHERE jsonb_typeof(c.response::jsonb #> '{choices,0,message}') = 'object'
"""

PG_TRAJECTORIES = """
CREATE VIEW trajectories AS
SELECT r.id AS run_id, r.group_id AS group_id, r.reward AS reward, r.status AS status,
       (SELECT count(*) FROM completions AS c WHERE c.run_id = r.id)::integer AS n_completions,
       (SELECT CASE WHEN jsonb_typeof(c.request::jsonb -> 'messages') = 'array'
                    THEN c.request::jsonb -> 'messages' ELSE '[]'::jsonb END
               || CASE WHEN jsonb_typeof(c.response::jsonb #> '{choices,0,message}') = 'object'
                       THEN jsonb_build_array(c.response::jsonb #> '{choices,0,message}')
                       ELSE '[]'::jsonb END
        FROM completions AS c WHERE c.run_id = r.id ORDER BY c.seq DESC LIMIT 1) AS messages
FROM runs AS r
"""


def upgrade() -> None:
    op.create_table(
        "runs",
        column("id", sa.String(length=128), "X-Run-Id of the episode", nullable=False),
        column(
            "group_id",
            sa.String(length=128),
            "X-Group-Id, or a hash of policy+tools+prompt of its first completion",
        ),
        column("policy", sa.String(length=256), "policy of its first completion"),
        column("status", sa.String(length=16), nullable=False),
        column("reward", sa.Float()),
        column("metrics", JSON, "named numbers posted with the reward"),
        column("metadata", JSON, "free JSON posted with the reward"),
        column("created_at", sa.DateTime(timezone=True), nullable=False),
        column("completed_at", sa.DateTime(timezone=True), "when rewarded"),
        column("trained_step", sa.Integer(), "training_steps.step that used it"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index("ix_runs_created_at", ["created_at", "id"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_group_id"), ["group_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_status"), ["status"], unique=False)
        batch_op.create_index("ix_runs_status_group", ["status", "group_id"], unique=False)

    op.create_table(
        "training_steps",
        column("id", sa.Integer(), nullable=False, autoincrement=True),
        column("step", sa.Integer(), "1,2,... per policy; adapter served as policy@step", nullable=False),
        column("policy", sa.String(length=256), nullable=False),
        column("adapter_path", sa.Text(), "checkpoint folder holding the adapter"),
        column("started_at", sa.DateTime(timezone=True)),
        column("finished_at", sa.DateTime(timezone=True)),
        column("num_groups", sa.Integer()),
        column("num_runs", sa.Integer()),
        column("num_tokens", sa.Integer(), "sampled tokens trained on"),
        column("mean_reward", sa.Float()),
        column("loss", sa.Float()),
        column("metrics", JSON, "loss/, kl/, clip/, reward/, perf/ numbers"),
        column("config", JSON, "resolved trainer settings of this step"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("policy", "step", name="uq_training_steps_policy_step"),
    )
    op.create_table(
        "completions",
        column("id", sa.Integer(), nullable=False, autoincrement=True),
        column("run_id", sa.String(length=128), "NULL when the request carried no run key"),
        column("seq", sa.Integer(), "0,1,2,... order of the call within its run"),
        column("policy", sa.String(length=256), "policy the request named"),
        column("adapter", sa.String(length=256), "model the upstream served: base or policy@step"),
        column("policy_step", sa.Integer(), "0 = base model"),
        column("endpoint", sa.String(length=64), "chat.completions or completions"),
        column("stream", sa.Boolean()),
        column("request", JSON, "the client's request body, as sent"),
        column("response", JSON, "the response as the client got it (streams assembled)"),
        column("prompt_token_ids", JSON),
        column("token_ids", JSON, "sampled token ids, one list per choice"),
        column("logprobs", JSON, "sampling logprobs, one list per choice"),
        column("finish_reason", sa.String(length=32)),
        column("status", sa.String(length=16), "ok, error, cancelled (client disconnected)"),
        column("status_code", sa.Integer()),
        column("error", sa.Text()),
        column("latency_ms", sa.Float()),
        column("ttft_ms", sa.Float(), "time to first token (streams)"),
        column("prompt_tokens", sa.Integer()),
        column("completion_tokens", sa.Integer()),
        column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "seq", name="uq_completions_run_seq"),
    )
    with op.batch_alter_table("completions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_completions_created_at"), ["created_at"], unique=False)

    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_MESSAGES)
        op.execute(PG_TRAJECTORIES)
    else:
        op.execute(SQLITE_MESSAGES)
        op.execute(SQLITE_TRAJECTORIES)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS trajectories")
    op.execute("DROP VIEW IF EXISTS messages")
    with op.batch_alter_table("completions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_completions_created_at"))

    op.drop_table("completions")
    op.drop_table("training_steps")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_status_group")
        batch_op.drop_index(batch_op.f("ix_runs_status"))
        batch_op.drop_index(batch_op.f("ix_runs_group_id"))
        batch_op.drop_index("ix_runs_created_at")

    op.drop_table("runs")
