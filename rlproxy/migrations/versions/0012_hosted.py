"""hosted upstreams: completions.source, why a row has no token ids (owner: issue 25)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01

A policy can be served by a hosted, text-only upstream (OpenAI, a gateway: `hosted_upstreams`),
which returns no token ids. Its rows keep the messages, tool calls and usage the client saw, with
`prompt_token_ids`, `token_ids` and `logprobs` NULL, and say so:

- `completions.source` VARCHAR(16) NULL: `hosted` for a row a text-only upstream answered (never a
  GRPO sample: the trainer skips such runs with status_reason `hosted` and counts them; SFT and
  distillation data: `rlproxy sft --from-policy`); NULL for a row captured with exact tokens
  (every row before this migration).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import add_column

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SOURCE_COMMENT = (
    "hosted: a text-only upstream answered (token ids NULL: SFT data, never a GRPO sample); "
    "NULL: captured with exact tokens"
)


def upgrade() -> None:
    add_column("completions", sa.Column("source", sa.String(length=16), comment=SOURCE_COMMENT))


def downgrade() -> None:
    # Plain ALTER TABLE (SQLite >= 3.35): a batch copy of the table would trip over the views.
    op.drop_column("completions", "source")
