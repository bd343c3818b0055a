"""A helper of the SFT and fork tests: `build_app` (what `rlproxy serve` runs) under uvicorn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
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
