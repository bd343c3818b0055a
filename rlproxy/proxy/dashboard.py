"""The dashboard: `GET /` serves one static page that reads the proxy's own JSON routes.

No build step and nothing from a CDN: the page, its style, its chart code and its script are files
in `rlproxy/proxy/static/`, served as they are with a strict Content-Security-Policy (scripts and
styles from this origin only, no framing, `nosniff`). The page holds no data, so it is public; the
script asks for the operators' key (`RLPROXY_ADMIN_KEY`: an input field, or `#key=` in the URL, a
fragment the browser never sends, so the key is in no request line and no access log) and sends it
as a Bearer header to the JSON routes it reads, which are operator routes (see proxy/auth.py). Its
requests are same-origin, so the guard's Origin check lets them by.

Routes of its own (operators only: `/v1/training` and `/v1/admin/` prefixes), plain functions of the
database that `serve` and the read-only `rlproxy dashboard` both route here:

    GET /v1/training/metrics  the per-step metric columns of `training_steps`, oldest first
    GET /v1/training/groups   every rewarded group over time, skipped ones included (storage/overview.py)
    GET /v1/admin/runs        runs under filters with a total, for the page's list and its paging
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.responses import Response

from rlproxy.errors import APIError
from rlproxy.proxy.rules import ROUTE_RULES
from rlproxy.storage import overview, queries
from rlproxy.storage.step_columns import STEP_COLUMNS as METRIC_COLUMNS
from rlproxy.storage.step_columns import STEP_METRIC_COLUMNS

STATIC_DIR = Path(__file__).resolve().parent / "static"
# Only these files are served: a fixed list, so no request path ever reaches the file system.
ASSETS: dict[str, str] = {
    "app.js": "text/javascript; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The page and its files, public in the route rules (proxy/rules.py; a test keeps them = ASSETS).
PUBLIC_PATHS: tuple[str, ...] = tuple(
    p for p in ROUTE_RULES.public_paths if p == "/" or p.startswith("/dashboard/")
)
# Every dashboard file: no cache, and a browser that runs only our own scripts and styles, never
# framed (clickjacking), never sniffing a type, never sending the page's URL elsewhere.
SECURITY_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
# What the charts plot per step: `training_steps` columns; the metric ones are storage's one list
# (storage/step_columns.py STEP_METRIC_COLUMNS, migration 0005), so a new metric column shows up here.
STEP_COLUMNS: tuple[str, ...] = (
    "policy",
    "step",
    "finished_at",
    "num_runs",
    "num_tokens",
    "mean_reward",
    "val_reward",  # validation runs served by step - 1 (migration 0008; docs: Validation runs)
    "val_runs",
    "loss",
    *STEP_METRIC_COLUMNS,
)


def step_charts() -> list[dict[str, Any]]:
    """The page's per-step charts, in order: one per `StepChart` id of the metric columns (their
    series in column order), then the loss of GRPO steps and of SFT steps (`sft`: those steps only;
    a cross-entropy of ~7 next to a GRPO loss of ~1e-5 would flatten one of them)."""
    charts: dict[str, dict[str, Any]] = {}
    for column, spec in METRIC_COLUMNS.items():
        c = spec.chart
        if c is None:
            continue
        chart = charts.setdefault(c.id, {"id": c.id, "title": c.title, "unit": c.unit, "cols": []})
        chart["cols"].append(column)
        if c.series is not None:
            chart.setdefault("names", []).append(c.series)
        chart.update({k: v for k, v in (("yMin", c.y_min), ("yMax", c.y_max)) if v is not None})
    return [
        *charts.values(),
        {"id": "loss", "title": "loss", "unit": "GRPO steps", "cols": ["loss"]},
        {
            "id": "sft_loss",
            "title": "SFT loss",
            "unit": "cross-entropy, SFT steps",
            "cols": ["loss"],
            "sft": True,
            "yMin": 0,
        },
    ]


router = APIRouter(tags=["dashboard"])


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def index() -> FileResponse:
    """The dashboard page (HEAD too: Claude Code's first request checks the server is there)."""
    return FileResponse(
        STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS
    )


@router.get("/dashboard/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    """One of the page's scripts or its style sheet."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(status_code=404, detail=f"no dashboard file {name!r}")
    return FileResponse(STATIC_DIR / name, media_type=media_type, headers=SECURITY_HEADERS)


def default_policy(steps: list[dict[str, Any]]) -> str | None:
    """The policy the charts open on: the newest step's policy that has a trained reward to show.

    A fork or an init (step 1 copied, nothing trained yet) would otherwise open on empty charts.
    `steps` is newest first.
    """
    for s in steps:
        if s.get("mean_reward") is not None and s.get("kind") not in ("fork", "init"):
            return s["policy"]
    return steps[0]["policy"] if steps else None


async def step_metrics(
    engine: AsyncEngine, *, policy: str | None = None, limit: int = 1000
) -> dict[str, Any]:
    """The newest `limit` training steps (of `policy`, or all), oldest first, as the charts' series.

    `data` rows hold `STEP_COLUMNS` only (no config or metrics JSON: a thousand steps stay small);
    `charts` says what the page draws of them (`step_charts()`);
    `policies` lists every policy present, newest step's policy first; `default_policy` is the one
    the page opens on (`default_policy()`).
    """
    steps = await queries.list_training_steps(engine, policy=policy, limit=limit)  # newest first
    policies = list(dict.fromkeys(s["policy"] for s in steps))
    data = [{c: s.get(c) for c in STEP_COLUMNS} for s in reversed(steps)]
    return {
        "object": "training_metrics",
        "columns": list(STEP_COLUMNS),
        "charts": step_charts(),
        "policies": policies,
        "default_policy": default_policy(steps),
        "data": data,
    }


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _limit(limit: int, most: int = queries.MAX_LIMIT) -> int:
    if not 1 <= limit <= most:
        raise APIError(422, f"limit: must be between 1 and {most}", param="limit", code="invalid_value")
    return limit


@router.get("/v1/training/metrics")
async def training_metrics(request: Request, policy: str | None = None, limit: int = 1000) -> Response:
    """Per-step learning metrics for the dashboard's charts (operators only: `/v1/training`)."""
    body = await step_metrics(request.app.state.proxy.engine, policy=policy, limit=_limit(limit))
    return _json(body)


@router.get("/v1/training/groups")
async def training_groups(request: Request, policy: str | None = None, limit: int = 1000) -> Response:
    """Every rewarded group over time with its outcome: trained, skipped (and why) or waiting."""
    rows = await overview.group_rewards(
        request.app.state.proxy.engine, policy=policy, limit=_limit(limit, 10_000)
    )
    return _json({"object": "list", "data": rows})


def _time(value: str | None, name: str) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise APIError(
            422, f"{name}: an ISO 8601 time, e.g. 2026-12-01T10:00:00Z", param=name, code="invalid_value"
        ) from None


@router.get("/v1/admin/runs")
async def admin_runs(
    request: Request,
    status: str | None = None,
    policy: str | None = None,
    group_id: str | None = None,
    split: str | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    since: str | None = None,
    until: str | None = None,
    q: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> Response:
    """Runs under every filter the page offers, newest first, with the total for paging."""
    if offset < 0:
        raise APIError(422, "offset: must be >= 0", param="offset", code="invalid_value")
    runs, total = await overview.find_runs(
        request.app.state.proxy.engine,
        status=status or None,
        policy=policy or None,
        group_id=group_id or None,
        split=split or None,
        min_reward=min_reward,
        max_reward=max_reward,
        since=_time(since, "since"),
        until=_time(until, "until"),
        q=q or None,
        limit=_limit(limit),
        offset=offset,
    )
    return _json({"object": "list", "data": runs, "total": total, "offset": offset, "limit": limit})
