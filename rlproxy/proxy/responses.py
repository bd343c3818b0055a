"""`POST /v1/responses`: the Responses API served by the proxy over the upstream's chat completions.

The route is a hot route like chat (`routes_openai.complete`): the Responses body is translated
(`wire/responses.py`) into the chat body the model sees, which then takes the chat path unchanged
(policy routing, injected `return_token_ids`/`logprobs`, capture, store), and the chat answer is
translated back: a Responses object, or (streamed) Responses SSE events made from the chat chunks as
they arrive. So every backend gives exact prompt and sampled token ids and sampling logprobs, text and
function calls alike.

Stored (see migration 0003): `request`/`response` hold the chat form, `client_request`/
`client_response` what the client sent and got, `response_id` the id a later `previous_response_id`
names. A chained request continues from the stored chat messages of the response it names (store
first, then the writer's queue: a chain may follow its previous turn before that is committed).
Without a run key of its own, a chained request joins the run of the response it continues, while
that run is open (proxy/runstate.py decides: issue 22). On a store several replicas write
(PostgreSQL), a previous response not found yet is looked up again for the writer's PEER_GRACE_S
(the turn before may have ended on another replica a moment ago), as a reward's run is.
`GET /v1/responses/{id}` answers the stored Responses object (`retrieve`).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import orjson
from starlette.responses import Response

from rlproxy.errors import APIError
from rlproxy.proxy import keys
from rlproxy.proxy.stream import EventStream
from rlproxy.storage import queries
from rlproxy.storage.writer import PEER_GRACE_S, PEER_RETRY_S
from rlproxy.wire.response_events import ResponseEvents, response_object
from rlproxy.wire.responses import ResponsesInputError, chat_request, conversation


@dataclass(slots=True)
class Call:
    """One Responses call on its way through the chat path."""

    body: dict  # the client's Responses body
    chat: dict  # the chat-completions body made from it (what is forwarded and stored as `request`)
    run_id: str | None  # the run of the previous response (inherited when the request names none)
    response_id: str = field(default_factory=lambda: f"resp_{os.urandom(16).hex()}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def store(self) -> bool:
        """False when the client said `store: false`: the response cannot be continued later."""
        return self.body.get("store") is not False

    def answer(self, chat: dict) -> dict:
        """The client's Responses object for the chat completion `chat`."""
        return response_object(self.body, chat, response_id=self.response_id, created_at=self.created_at)

    def events(self, model: str) -> EventStream:
        """The translator of the chat stream into Responses events."""
        return EventStream(
            ResponseEvents(self.body, response_id=self.response_id, created_at=self.created_at, model=model)
        )


async def prepare(px, scope, body: dict) -> Call:
    """Translate `body` (400 for what cannot be served, 404 for an unknown `previous_response_id`)."""
    history, run_id, key = None, None, scope.get(keys.SCOPE_KEY)
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        if not isinstance(prev_id, str):
            raise APIError(400, "previous_response_id: must be a string", param="previous_response_id")
        prev = await _stored(px, prev_id, peer_grace=True, key=key)
        message = ((prev or {}).get("response") or {}).get("choices") or [{}]
        if prev is None or not isinstance(message[0].get("message"), dict):
            raise APIError(
                404,
                f"Previous response with id '{prev_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = conversation(prev.get("request") or {}, message[0]["message"])
        run_id = prev.get("run_id")
    try:
        chat = chat_request(body, history)
    except ResponsesInputError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    return Call(body=body, chat=chat, run_id=run_id)


async def _stored(px, response_id: str, peer_grace: bool = False, key=None) -> dict | None:
    """The stored response `response_id` of app key `key` (None: the shared agents' key), or None:
    another app's response is not found, as an id nobody used (proxy/keys.py)."""
    row = await _lookup(px, response_id, key)
    if row is None and px.writer.may_hold(response_id):  # queued: the previous turn ended just now
        # (only then: a flush for an id this replica never queued made unknown ids cost a commit)
        try:
            await asyncio.wait_for(px.writer.flush(), px.settings.store_wait_timeout)
        except TimeoutError:
            return None
        row = await _lookup(px, response_id, key)
    if row is None and peer_grace and px.engine.dialect.name != "sqlite":
        # several replicas on one store: the previous turn may have ended on another replica, whose
        # writer commits it within its flush interval. The same grace as a reward's (writer.py).
        deadline = time.monotonic() + PEER_GRACE_S
        while row is None and time.monotonic() < deadline:
            await asyncio.sleep(PEER_RETRY_S)
            row = await _lookup(px, response_id, key)
    return row


async def _lookup(px, response_id: str, key) -> dict | None:
    row = _decode(await queries.stored_response(px.engine, response_id))
    if row is not None and row.get("key_id") != (key.id if key is not None else None):
        return None
    return row


def _decode(row: dict | None) -> dict | None:
    if row is None:
        return None
    for key in ("request", "response", "client_response"):
        if isinstance(row.get(key), str | bytes):  # a driver that hands back JSON text
            row[key] = orjson.loads(row[key])
    return row


async def side(px, request, path: str) -> Response | None:
    """`GET /v1/responses/{id}`, served from the store (the caller's app key's only); None for any
    other request below /v1/responses (relayed)."""
    if request.method == "GET" and path.count("/") == 1:
        return await retrieve(px, path[len("responses/") :], keys.of(request.scope))
    return None


async def retrieve(px, response_id: str, key=None) -> Response:
    """`GET /v1/responses/{response_id}`: the stored Responses object of app key `key` (404 if none,
    another app's, or `store: false`)."""
    row = await _stored(px, response_id, key=key)
    if row is None or not isinstance(row.get("client_response"), dict):
        raise APIError(
            404,
            f"Response with id '{response_id}' not found.",
            param="response_id",
            code="response_not_found",
        )
    return Response(orjson.dumps(row["client_response"]), media_type="application/json")
