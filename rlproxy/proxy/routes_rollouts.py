"""The canary panel (issue 28): `GET /rollouts`, a page of its own beside the dashboard, and its data
`GET /v1/training/rollouts` (operators only: a `/v1/training` route), the newest rollouts and, for
the newest one (or `?id=N`), both arms' rewarded runs in reward order, which the page draws as each
arm's running mean reward over time, and the shadow checks (issue 54, trainer/shadow.py) from
`GET /v1/training/shadow_checks`: each new step against the serving step on stored prompts, before it
served anyone. The page carries the dashboard's headers (a CSP with no inline script or style, no
framing, nosniff); its script is `/dashboard/rollouts.js`, which sets every value as text, never as
HTML."""

from __future__ import annotations

from pathlib import Path

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse

from rlproxy.errors import APIError
from rlproxy.proxy.dashboard import SECURITY_HEADERS
from rlproxy.proxy.validate import Int64, OptInt64
from rlproxy.storage import rollouts as store
from rlproxy.storage import shadow as shadow_store

PAGE = Path(__file__).resolve().parent / "static" / "rollouts.html"

router = APIRouter(tags=["rollouts"])


@router.get("/rollouts", include_in_schema=False)
async def page() -> FileResponse:
    """The canary panel (a public route, proxy/rules.py: its data needs the admin key)."""
    return FileResponse(PAGE, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


@router.get("/v1/training/rollouts")
async def rollouts(request: Request, id: OptInt64 = None, limit: Int64 = 20) -> Response:
    """The newest `limit` rollouts, and the series of rollout `id` (default: the newest)."""
    if not 1 <= limit <= 1000:
        raise APIError(422, "limit: must be between 1 and 1000", param="limit", code="invalid_value")
    engine = request.app.state.proxy.engine
    rows = await store.list_rollouts(engine, limit=limit)
    chosen = next((r for r in rows if r["id"] == id), None) if id is not None else (rows[0] if rows else None)
    if id is not None and chosen is None:
        chosen = await store.get_rollout(engine, id)
        if chosen is None:
            raise APIError(404, f"no rollout {id}", param="id", code="not_found")
    chart = None
    if chosen is not None:
        chart = {k: chosen[k] for k in ("id", "policy", "candidate_step", "incumbent_step", "status")}
        chart["series"] = await store.arm_series(engine, chosen["id"])
    body = {"object": "list", "data": rows, "chart": chart}
    return Response(orjson.dumps(body), media_type="application/json")


@router.get("/v1/training/shadow_checks")
async def shadow_checks(request: Request, policy: str | None = None, limit: Int64 = 50) -> Response:
    """The newest `limit` shadow checks (of `policy`), newest first, each with its pairs' scores."""
    if not 1 <= limit <= 1000:
        raise APIError(422, "limit: must be between 1 and 1000", param="limit", code="invalid_value")
    rows = await shadow_store.list_checks(request.app.state.proxy.engine, policy=policy, limit=limit)
    return Response(orjson.dumps({"object": "list", "data": rows}), media_type="application/json")
