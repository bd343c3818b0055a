"""views a newcomer reads: untagged traffic (owner: issue 26)

`untagged`: one row per completion stored without a run key (no `X-Run-Id`, no `/runs/{id}/v1`
base URL), newest first in practice (`ORDER BY created_at DESC` when you read it), with the `id` the
client got in its response (`reply_id`: `chatcmpl-...`, `cmpl-...`, `resp_...`, `msg_...`), which
is what `POST /v1/completions/{reply_id}/reward` takes (proxy/routes_untagged.py). Once rewarded
that way, the completion belongs to a run of its own and leaves this view.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNTAGGED = """
CREATE VIEW untagged AS
SELECT c.id AS completion_id,
       coalesce(c.response_id, {client_id}, {id}){sep}AS reply_id,
       c.created_at AS created_at, c.policy AS policy, c.policy_step AS policy_step,
       c.endpoint AS endpoint, c.status AS status, c.status_code AS status_code,
       c.finish_reason AS finish_reason, c.prompt_tokens AS prompt_tokens,
       c.completion_tokens AS completion_tokens, c.latency_ms AS latency_ms
FROM completions AS c
WHERE c.run_id IS NULL
"""
SQLITE_UNTAGGED = UNTAGGED.format(
    client_id="json_extract(c.client_response, '$.id')",
    id="json_extract(c.response, '$.id')",
    sep="\n         ",
)
PG_UNTAGGED = UNTAGGED.format(
    client_id="c.client_response::jsonb ->> 'id'", id="c.response::jsonb ->> 'id'", sep=" "
)


def upgrade() -> None:
    op.execute(SQLITE_UNTAGGED if op.get_context().dialect.name == "sqlite" else PG_UNTAGGED)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS untagged")
