"""Untagged traffic: listed for operators, rewardable by the `id` its client got.

An app that changed only its base URL sends no `X-Run-Id`: each of its requests is stored with
`run_id` NULL (never trained on its own). Two routes make that traffic useful:

    GET  /v1/admin/untagged                 operators: the count and the newest untagged requests
                                            (`limit`, `before` for paging), as the `untagged` view
    POST /v1/completions/{reply_id}/reward  agents: the reward of the response whose `id` was
                                            `reply_id` (`chatcmpl-...`, `cmpl-...`, `resp_...`)
    POST /v1/completions/{reply_id}/complete  the same for the judge (as `/v1/runs/{id}/complete`)

The reward route makes the reply a one-call run named `reply_id` (its group: the default group of
its prompt, as for any run, so replies to the same prompt group together), then stores the reward
exactly as `POST /v1/runs/{reply_id}/reward` would: the same body, answers and durability; later it
is that run (`rlproxy runs show chatcmpl-...`). Tenancy: the reply id is the capability, held by
the client that got the response, as a run id is for a tagged run. A reply that belongs to a tagged
run is a 409 `reply_in_run` that does not name the run (reward it by its run id); an unknown reply
404 `reply_not_found`, once the writer has committed what it holds.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from rlproxy.errors import APIError, RLProxyError
from rlproxy.proxy import keys, routes_runs, runkey
from rlproxy.proxy.validate import Int64, OptInt64
from rlproxy.storage import untagged

router = APIRouter()


@router.get("/v1/admin/untagged")
async def list_untagged(request: Request, limit: Int64 = 50, before: OptInt64 = None) -> Response:
    """The number of untagged requests and the newest `limit` of them (operators only)."""
    if not 1 <= limit <= 1000:
        raise APIError(422, "limit: must be between 1 and 1000", param="limit", code="invalid_value")
    engine = request.app.state.proxy.engine
    rows, nxt = await untagged.list_untagged(engine, limit=limit, before=before)
    total = await untagged.count_untagged(engine)
    return routes_runs._json({"object": "list", "total": total, "data": rows, "next_before": nxt})


@router.post("/v1/completions/{reply_id}/reward")
@router.post("/v1/completions/{reply_id}/complete")  # served here, never relayed to the upstream
async def post_reply_reward(request: Request, reply_id: str) -> Response:
    """The reward of one untagged response, named by the `id` it carried, or (`/complete`) its
    completion for the judge (see the module doc)."""
    runkey.check_id(reply_id, "reply id")
    px = request.app.state.proxy
    key = keys.of(request.scope)  # an app's key rewards its own replies only (proxy/keys.py)
    key_id = key.id if key is not None else None
    run_name = keys.scoped(key, reply_id, "reply id")  # the run it becomes, in the key's namespace
    # what the writer holds first: the reply may still be queued, and so may a later reply of the
    # key that carried the same id (an upstream that repeats its ids): ambiguous, never one picked
    await px.writer.flush()
    found = await untagged.find_reply(px.engine, reply_id, key_id, run_name)
    if found is None:
        raise APIError(
            404,
            f"no response with id {reply_id!r} is stored (a reply's `id`, e.g. chatcmpl-...)",
            param="reply_id",
            code="reply_not_found",
        )
    if found.get("ambiguous"):
        raise APIError(
            409,
            f"several of your replies carried the id {reply_id!r} (the upstream repeats its ids): "
            "it names no one reply; send an X-Run-Id with each request and reward the run instead",
            param="reply_id",
            code="reply_ambiguous",
        )
    if found.get("tagged"):
        raise APIError(
            409,
            "this response belongs to a run with its own id (X-Run-Id): post the reward to that run",
            param="reply_id",
            code="reply_in_run",
        )
    if found["run_id"] is None:
        request_body = found.get("request") if isinstance(found.get("request"), dict) else {}
        group = runkey.default_group(found.get("policy"), request_body)
        adopted = await untagged.adopt(
            px.engine,
            found["id"],
            run_name,
            policy=found.get("policy"),
            group_id=keys.scoped(key, group, "group id"),
            created_at=found.get("created_at"),
            key_id=key_id,
        )
        if not adopted:
            raise APIError(
                409,
                f"a run named {reply_id!r} exists already: reward this response by that run's id",
                param="reply_id",
                code="reply_in_run",
            )
    declared = request.headers.get("content-length")
    judge = request.url.path.endswith("/complete")
    body = declared.encode() if declared else None
    try:
        return await routes_runs._reward(px, request.receive, body, run_name, judge=judge, shown=reply_id)
    except RLProxyError as exc:
        keys.unscope_error(exc, key)  # the app's reply id as it knows it
        raise
