"""The dashboard: `GET /` serves one static page that reads the proxy's own JSON routes.

No build step and nothing from a CDN: the page, its chart code and its script are files in
`rlproxy/proxy/static/`, served as they are. The page holds no data, so it is public; the script
asks for the operators' key (`RLPROXY_ADMIN_KEY`; `?key=` or an input field) and sends it as a
Bearer header to the JSON routes it reads (all runs, run stats, training steps), which are operator
routes (see proxy/auth.py). Its requests are same-origin, so the guard's Origin check lets them by.

Its learning charts read `GET /v1/training/metrics` (an operator route: `/v1/training` prefix): the
per-step metric columns of `training_steps`, oldest first, from `step_metrics(engine)`, a plain
function of the database that `serve` and the read-only `rlproxy dashboard` both route here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.responses import Response

from rlproxy.errors import APIError
from rlproxy.storage import queries

STATIC_DIR = Path(__file__).resolve().parent / "static"
# Only these files are served: a fixed list, so no request path ever reaches the file system.
ASSETS: dict[str, str] = {
    "app.js": "text/javascript; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
}
# The paths the API-key check must let through (they carry no data).
PUBLIC_PATHS: tuple[str, ...] = ("/", *(f"/dashboard/{name}" for name in ASSETS))
_NO_CACHE = {"Cache-Control": "no-cache"}
# What the charts plot per step: `training_steps` columns (the metric ones: migration 0005).
STEP_COLUMNS: tuple[str, ...] = (
    "policy",
    "step",
    "kind",
    "finished_at",
    "num_runs",
    "num_tokens",
    "mean_reward",
    "reward_std",
    "val_reward",  # validation runs served by step - 1 (migration 0008; README: Validation runs)
    "val_runs",
    "zero_variance_frac",
    "loss",
    "kl",
    "clip_frac_low",
    "clip_frac_high",
    "entropy",
    "completion_len_mean",
    "policy_lag_mean",
    "tokens_per_s",
    "grad_norm",
)

router = APIRouter(tags=["dashboard"])


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    """The dashboard page."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_NO_CACHE)


@router.get("/dashboard/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    """One of the page's scripts."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(status_code=404, detail=f"no dashboard file {name!r}")
    return FileResponse(STATIC_DIR / name, media_type=media_type, headers=_NO_CACHE)


async def step_metrics(
    engine: AsyncEngine, *, policy: str | None = None, limit: int = 1000
) -> dict[str, Any]:
    """The newest `limit` training steps (of `policy`, or all), oldest first, as the charts' series.

    `data` rows hold `STEP_COLUMNS` only (no config or metrics JSON: a thousand steps stay small);
    `policies` lists every policy present, newest step's policy first (the page's default).
    """
    steps = await queries.list_training_steps(engine, policy=policy, limit=limit)  # newest first
    policies = list(dict.fromkeys(s["policy"] for s in steps))
    data = [{c: s.get(c) for c in STEP_COLUMNS} for s in reversed(steps)]
    return {"object": "training_metrics", "columns": list(STEP_COLUMNS), "policies": policies, "data": data}


@router.get("/v1/training/metrics")
async def training_metrics(request: Request, policy: str | None = None, limit: int = 1000) -> Response:
    """Per-step learning metrics for the dashboard's charts (operators only: `/v1/training`)."""
    if not 1 <= limit <= queries.MAX_LIMIT:
        raise APIError(
            422, f"limit: must be between 1 and {queries.MAX_LIMIT}", param="limit", code="invalid_value"
        )
    body = await step_metrics(request.app.state.proxy.engine, policy=policy, limit=limit)
    return Response(orjson.dumps(body), media_type="application/json")
