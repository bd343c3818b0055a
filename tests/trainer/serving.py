"""A helper of the SFT, fork and shadow tests: `build_app` (what `rlproxy serve` runs) under uvicorn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from support import uvicorn_serving

from rlproxy.compose import build_app
from rlproxy.settings import Settings


@asynccontextmanager
async def serving(settings: Settings, backend: Any) -> AsyncIterator[str]:
    """`build_app(settings, backend)` under uvicorn on loopback port `settings.port`; yields its base URL."""
    async with uvicorn_serving(build_app(settings, backend), settings.port) as base:
        yield base
