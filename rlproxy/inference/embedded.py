"""The embedded backend: the engine's OpenAI app served by uvicorn inside the caller's event loop.

The proxy talks to it over loopback HTTP exactly as it talks to vLLM, so the two backends cannot be
told apart; only adapter loads take a shortcut (a direct call into the engine's worker thread,
with the same errors the HTTP route gives). With `api_key` (the composition root passes a random
per-process secret) the loopback server answers only requests that carry it; the proxy's forwarder
sends it (`api_key` is what `forward.Upstream` reads from the backend), `/health` stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from rlproxy.errors import BackendUnavailable
from rlproxy.inference.engine import Engine
from rlproxy.inference.engine_metrics import EngineCollector
from rlproxy.inference.models import resolve_model, served_name
from rlproxy.inference.server import create_engine_app

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024  # completion cap of a chat request without max_tokens (issue 22: not the context)
DEFAULT_PREFIX_CACHE_BYTES = 512 * 2**20  # the prefix KV cache's bound (settings.engine_prefix_cache_bytes)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the host process (the proxy's own server)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class EmbeddedBackend:
    """Backend: the in-process transformers + peft engine behind a loopback OpenAI server."""

    def __init__(
        self,
        model: str,
        cache_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        threads: int | None = None,
        max_batch: int = 16,
        api_key: str | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
    ) -> None:
        self.model = model
        self.prefix_cache_bytes = prefix_cache_bytes  # the engine's prefix KV cache (0 = off)
        self.default_max_tokens = default_max_tokens
        self.api_key = api_key  # the bearer secret the engine requires (None: open, loopback only)
        self.cache_dir = cache_dir
        self.host = host
        self.port = port  # 0 = any free port, known after start()
        self.threads = threads
        self.max_batch = max_batch
        self.engine: Engine | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self._model_path: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_urls(self) -> tuple[str, ...]:
        return (self.base_url,)  # one in-process engine

    @property
    def served_model(self) -> str:
        return served_name(self.model)

    @property
    def model_path(self) -> str:
        if self._model_path is None:
            self._model_path = resolve_model(self.model, cache_dir=self.cache_dir)
        return self._model_path

    async def start(self) -> None:
        """Load the model off the event loop, then serve it on a loopback port until stop()."""
        if self._task is not None:
            return
        path = await asyncio.to_thread(lambda: self.model_path)
        self.engine = await asyncio.to_thread(
            Engine,
            path,
            served_name=self.served_model,
            threads=self.threads,
            max_batch=self.max_batch,
            prefix_cache_bytes=self.prefix_cache_bytes,
            default_max_tokens=self.default_max_tokens,
        )
        self.engine.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_engine_app(self.engine, api_key=self.api_key),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=5,  # streams still open at stop() are cut after 5 s
        )
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="rlproxy-embedded-engine")
        for _ in range(200):
            if self._task.done():
                await self.stop()
                raise BackendUnavailable(f"the embedded engine's HTTP server exited on {self.base_url}")
            if await self.health():
                log.info("embedded engine serving %s at %s", self.served_model, self.base_url)
                return
            await asyncio.sleep(0.05)
        await self.stop()
        raise BackendUnavailable(f"the embedded engine did not become healthy at {self.base_url}")

    async def stop(self) -> None:
        """Stop the HTTP server and the worker thread; idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=10)
            except Exception:  # noqa: BLE001 - a timeout or a crashed server: shut down regardless
                self._task.cancel()
            self._task = None
        self._server = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(engine.close)

    async def shared_base(self) -> Any:
        """The base model as a twin sharing the engine's weight tensors (one copy in memory): what a
        trainer in this process should put its LoRA on instead of loading the weights again."""
        if self.engine is None:
            raise BackendUnavailable("the embedded engine is not started")
        return await asyncio.wrap_future(self.engine.shared_base())

    def metrics_collector(self) -> EngineCollector:
        """A Prometheus collector of this backend's engine figures, read at scrape time (register it
        in the proxy's registry; it reports nothing while the engine is not started)."""
        return EngineCollector(lambda: self.engine)

    async def health(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                return (await client.get(f"{self.base_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve `path` as `name`, replacing an adapter of that name (in-flight rows keep the old one)."""
        if self.engine is None:
            raise BackendUnavailable("the embedded engine is not started")
        await asyncio.wrap_future(self.engine.load_adapter(name, str(path), load_inplace=True))

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name`; AdapterError(status=404) if it is not loaded."""
        if self.engine is None:
            raise BackendUnavailable("the embedded engine is not started")
        await asyncio.wrap_future(self.engine.unload_adapter(name))

    async def load_adapters_into(self, url: str, adapters: dict[str, str] | None = None) -> None:
        """The one replica is this engine, which keeps its adapters: only `adapters` are (re)loaded."""
        for name, path in (adapters or {}).items():
            await self.load_adapter(name, path)


def run_engine(
    model: str,
    server_config: Callable[[Any], uvicorn.Config],
    threads: int | None = None,
    cache_dir: str | Path | None = None,
    max_batch: int = 16,
    api_key: str | None = None,
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> None:
    """Serve the embedded engine alone until interrupted (`rlproxy engine`); `api_key` as above.

    `server_config(app)` is the uvicorn.Config to serve the engine's app with (the CLI passes the
    proxy's own, limits included: this package does not import the proxy).
    """
    path = resolve_model(model, cache_dir=cache_dir)
    engine = Engine(
        path,
        served_name=served_name(model),
        threads=threads,
        max_batch=max_batch,
        prefix_cache_bytes=prefix_cache_bytes,
        default_max_tokens=default_max_tokens,
    )
    engine.start()
    try:
        config = server_config(create_engine_app(engine, api_key=api_key))
        log.info("serving %s (%s) at http://%s:%d/v1", served_name(model), path, config.host, config.port)
        uvicorn.Server(config).run()
    finally:
        engine.close()
