"""the Responses API: completions.response_id, client_request, client_response

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

rlproxy serves `POST /v1/responses` itself over the upstream's chat completions
(`rlproxy/inference/responses.py`). A Responses call is stored as one `completions` row with
`endpoint = 'responses'` holding what the model actually saw, in chat form, so the `messages` and
`trajectories` views, the default group hash and the trainer treat it like any chat completion:

  request          the chat-completions body sent upstream (instructions as the system message, the
                   `previous_response_id` chain's messages, the input items as chat messages), without
                   the capture fields the proxy injected
  response         the chat completion the upstream answered (a stream assembled)
  prompt_token_ids, token_ids, logprobs   as for chat: exact, from the upstream

and what the client got is kept beside it (NULL on the other endpoints, where request/response are
already that):

  response_id      the Responses object's id (`resp_...`); NULL when the request said `store: false`,
                   so such a response cannot be continued with `previous_response_id`
  client_request   the Responses request body as the client sent it
  client_response  the Responses object the client received (a stream: the one its last event carried)

`previous_response_id` is resolved by `response_id` (unique index), so chains survive restarts and
work across replicas sharing one database.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from rlproxy.migrations.columns import add_column

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("response_id", sa.String(length=64), "Responses API: id of the response object; NULL if store: false"),
    ("client_request", sa.JSON(none_as_null=True), "Responses API: the request body as the client sent it"),
    ("client_response", sa.JSON(none_as_null=True), "Responses API: the response object the client received"),
)


def upgrade() -> None:
    for name, type_, comment in COLUMNS:
        add_column("completions", sa.Column(name, type_, comment=comment))
    op.create_index("ux_completions_response_id", "completions", ["response_id"], unique=True)


def downgrade() -> None:
    # Plain ALTER TABLE (SQLite >= 3.35): a batch copy of the table would trip over the views.
    op.drop_index("ux_completions_response_id", table_name="completions")
    for name, *_ in reversed(COLUMNS):
        op.drop_column("completions", name)
