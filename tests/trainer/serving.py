"""Helpers of the trainer's end-to-end tests: `build_app` (what `rlproxy serve` runs) under uvicorn, and
`rows`, a read-only query of the store."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn

from rlproxy.compose import build_app
from rlproxy.settings import Settings


@asynccontextmanager
async def serving(settings: Settings, backend: Any) -> AsyncIterator[str]:
    """`build_app(settings, backend)` under uvicorn on loopback port `settings.port`; yields its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(build_app(settings, backend), port=settings.port, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(1200):
            if server.started:
                break
            assert not task.done(), "the proxy exited during startup"
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)


def rows(db: Path, sql: str) -> list[tuple]:
    """The rows of a read-only `sql` on the SQLite store `db` (waits up to 30 s for a writer's lock)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()
