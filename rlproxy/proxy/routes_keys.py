"""`GET /v1/admin/keys` (operators): the apps' keys and what each did on this replica (issue 55).

Every key of the store, valid and revoked (`storage.keys.list_keys`: never a secret or its hash),
with this replica's counts since it started: requests admitted, tokens served, streams in flight,
refusals by reason (the same figures as `/metrics`' `rlproxy_key_*`). Keys are made and revoked with
`rlproxy keys` (docs/cli.md).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from rlproxy.proxy.routes_runs import _json
from rlproxy.storage import keys as store

router = APIRouter()


@router.get("/v1/admin/keys")
async def list_keys(request: Request) -> Response:
    """The keys, oldest first, each with `usage` on this replica (see the module doc)."""
    px = request.app.state.proxy
    rows = await store.list_keys(px.engine)
    for row in rows:
        row["usage"] = px.keys.usage(row["id"])
        for k in ("created_at", "revoked_at", "last_used_at"):
            row[k] = row[k].isoformat() if row[k] is not None else None
    return _json({"object": "list", "data": rows})
