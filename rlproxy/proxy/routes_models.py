"""`GET /v1/models` as agents see it: names, never the server's paths.

The inference server lists each model with `root` (the folder it was loaded from) and each adapter
with `root` (its checkpoint folder) and `parent`: through the proxy those would tell every agent the
model folder and the checkpoint layout of the host. This route relays the upstream's list and
replaces a `root` or `parent` that is a path by the entry's name (an adapter's `parent` by the name
of the model it belongs to); everything else is the upstream's, and a list without paths is relayed
byte for byte (issue 22, case 14). An app key limited to some policies (proxy/keys.py) sees only
their entries (`policy`, `policy@step`).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from rlproxy.proxy import keys, runkey

router = APIRouter()
MAX_LIST_BYTES = 4 * 1024 * 1024  # a models list is a few KB; past this it is relayed unread


def _is_path(value: Any) -> bool:
    return isinstance(value, str) and ("/" in value or "\\" in value)


def has_paths(body: dict[str, Any]) -> bool:
    entries = [e for e in body.get("data") or [] if isinstance(e, dict)]
    return any(_is_path(e.get("root")) or _is_path(e.get("parent")) for e in entries)


def names_only(body: dict[str, Any]) -> dict[str, Any]:
    """The models list with every path-valued `root` / `parent` replaced by a name."""
    entries = [e for e in body.get("data") or [] if isinstance(e, dict)]
    by_root = {e.get("root"): e.get("id") for e in entries if _is_path(e.get("root"))}
    for e in entries:
        if _is_path(e.get("root")):
            e["root"] = e.get("id")
        if _is_path(e.get("parent")):
            e["parent"] = (
                by_root.get(e["parent"]) or e["parent"].replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
            )
    return body


async def _models(request: Request) -> Response:
    px = request.app.state.proxy
    key = keys.of(request.scope)
    relayed = await px.upstream.relay(request, "/v1/models", px.drop_headers)
    body = getattr(relayed, "body_iterator", None)
    if relayed.status_code != 200 or body is None:
        return relayed
    chunks, size = [], 0
    async for chunk in body:
        chunks.append(chunk if isinstance(chunk, bytes) else str(chunk).encode())
        size += len(chunks[-1])
        if size > MAX_LIST_BYTES:
            break
    raw = b"".join(chunks)
    try:
        listed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        listed = None
    limited = key is not None and key.policies is not None and isinstance(listed, dict)
    if limited:  # only the policies the key may use: another app's are not even named
        listed["data"] = [
            e
            for e in listed.get("data") or []
            if isinstance(e, dict) and key.may_use(str(e.get("id", "")).partition("@")[0])
        ]
    if not isinstance(listed, dict) or size > MAX_LIST_BYTES or not (limited or has_paths(listed)):
        # nothing to hide: the upstream's bytes as they are
        return Response(raw, status_code=relayed.status_code, media_type=relayed.media_type)
    return Response(orjson.dumps(names_only(listed)), media_type="application/json")


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The upstream's models, by name."""
    return await _models(request)


@router.get("/runs/{run_id}/v1/models")
async def run_models(request: Request, run_id: str) -> Response:
    """The same under a path-form base URL."""
    runkey.check_id(run_id)
    return await _models(request)
