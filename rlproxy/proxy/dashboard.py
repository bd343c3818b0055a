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
    GET /v1/training/compare  two steps or policies side by side on the same val prompts (?a=&b=)
    GET /v1/admin/runs        runs under filters with a total, for the page's list and its paging
    GET /v1/admin/completions/{id}/tokens  one call's sampled tokens, logprobs and its run's cohort
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.responses import Response

from rlproxy.errors import APIError
from rlproxy.proxy.rules import ROUTE_RULES
from rlproxy.proxy.validate import Int64
from rlproxy.storage import overview, queries
from rlproxy.storage.step_columns import STEP_COLUMNS as METRIC_COLUMNS
from rlproxy.storage.step_columns import STEP_METRIC_COLUMNS

logger = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).resolve().parent / "static"
# Only these files are served: a fixed list, so no request path ever reaches the file system.
ASSETS: dict[str, str] = {
    "app.js": "text/javascript; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
    "dig.js": "text/javascript; charset=utf-8",
    "rollouts.js": "text/javascript; charset=utf-8",
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
async def training_metrics(request: Request, policy: str | None = None, limit: Int64 = 1000) -> Response:
    """Per-step learning metrics for the dashboard's charts (operators only: `/v1/training`)."""
    body = await step_metrics(request.app.state.proxy.engine, policy=policy, limit=_limit(limit))
    return _json(body)


@router.get("/v1/training/groups")
async def training_groups(request: Request, policy: str | None = None, limit: Int64 = 1000) -> Response:
    """Every rewarded group over time, one point per outcome: trained, skipped (and why), failed,
    waiting or ungrouped; `runs` counts the rewarded training runs per outcome, as the status cards."""
    engine = request.app.state.proxy.engine
    rows = await overview.group_rewards(engine, policy=policy, limit=_limit(limit, 10_000))
    runs = await overview.outcome_runs(engine, policy=policy)  # all runs, not only the points drawn
    return _json({"object": "list", "data": rows, "runs": runs})


@router.get("/v1/admin/runs")
async def admin_runs(
    request: Request, f: Annotated[overview.RunFilter, Depends()], limit: Int64 = 50, offset: Int64 = 0
) -> Response:
    """Runs under every filter the page offers, newest first, with the total for paging."""
    if offset < 0:
        raise APIError(422, "offset: must be >= 0", param="offset", code="invalid_value")
    try:
        runs, total = await overview.find_runs(request.app.state.proxy.engine, f, _limit(limit), offset)
    except ValueError as exc:
        name = str(exc)
        raise APIError(
            422, f"{name}: an ISO 8601 time, e.g. 2026-12-01T10:00:00Z", param=name, code="invalid_value"
        ) from None
    return _json({"object": "list", "data": runs, "total": total, "offset": offset, "limit": limit})


@router.get("/v1/training/compare")
async def training_compare(request: Request, a: str | None = None, b: str | None = None) -> Response:
    """Mean val reward per prompt of arm `a` and arm `b` (`policy@step`; default: the two newest)."""
    try:
        body = await overview.compare_val(request.app.state.proxy.engine, a, b)
    except ValueError as exc:
        raise APIError(
            422, str(exc), param="a" if a and "@" not in a else "b", code="invalid_value"
        ) from None
    return _json(body)


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str) -> Any:
    """The served model's tokenizer from its local folder (never the network), loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _decode(path: str, rows: list[list[int]]) -> list[list[str]]:
    tok = _tokenizer(path)
    return [[tok.decode([int(t)]) for t in ids] for ids in rows]


@router.get("/v1/admin/completions/{completion_id}/tokens")
async def completion_tokens(
    request: Request, completion_id: Annotated[int, PathParam(ge=1, le=2**63 - 1)]
) -> Response:
    """One call's sampled token ids and logprobs per choice, their text pieces when the served model's
    tokenizer is at hand (`pieces`, else null: the read-only dashboard has no model), and the reward
    and group of its run (advantages are not stored: see storage/overview.py completion_tokens)."""
    px = request.app.state.proxy
    body = await overview.completion_tokens(px.engine, completion_id)
    if body is None:
        raise APIError(404, f"no completion {completion_id}", code="not_found")
    body["pieces"] = None
    path = getattr(px.backend, "model_path", None) if px.backend is not None else None
    if path and body["token_ids"]:
        try:
            body["pieces"] = await asyncio.get_running_loop().run_in_executor(
                None, _decode, str(path), body["token_ids"]
            )
        except Exception as exc:  # no local tokenizer (a remote upstream): ids and logprobs only
            logger.info("token view: no tokenizer at %s (%s)", path, exc)
    return _json(body)
