"""The dashboard: `GET /` serves one static page that reads the proxy's own JSON routes.

No build step and nothing from a CDN: the page, its chart code and its script are files in
`rlproxy/proxy/static/`, served as they are. The page holds no data, so it is public; the script
asks for the operators' key (`RLPROXY_ADMIN_KEY`; `?key=` or an input field) and sends it as a
Bearer header to the JSON routes it reads (all runs, run stats, training steps), which are operator
routes (see proxy/auth.py). Its requests are same-origin, so the guard's Origin check lets them by.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent / "static"
# Only these files are served: a fixed list, so no request path ever reaches the file system.
ASSETS: dict[str, str] = {
    "app.js": "text/javascript; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
}
# The paths the API-key check must let through (they carry no data).
PUBLIC_PATHS: tuple[str, ...] = ("/", *(f"/dashboard/{name}" for name in ASSETS))
_NO_CACHE = {"Cache-Control": "no-cache"}

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
