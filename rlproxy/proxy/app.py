"""The proxy application: `create_app(settings, backend, services)`.

The lifespan owns every resource and closes it in reverse order: the database (migrated to head on
start), the writer task, the backend (started or attached), the pooled upstream client, the
background tasks (policy poll, run expiry) and the caller's services (the trainer). Route modules
find all of it on `app.state.proxy` (a `ProxyState`); `app.state.policies.set_step` is what the
trainer's `on_publish` calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI

from rlproxy.inference.backend import Backend
from rlproxy.proxy import errors
from rlproxy.proxy.auth import APIKeyMiddleware
from rlproxy.proxy.gate import TrainGate
from rlproxy.proxy.inflight import InFlight
from rlproxy.proxy.metrics import Metrics
from rlproxy.proxy.policies import Policies
from rlproxy.proxy.settings import Settings

logger = logging.getLogger(__name__)


@dataclass
class ProxyState:
    """Everything the routes need; the resources are set by the lifespan."""

    settings: Settings
    backend: Backend
    policies: Policies
    gate: TrainGate
    metrics: Metrics = field(default_factory=Metrics)
    inflight: InFlight = field(default_factory=InFlight)
    engine: object = None  # AsyncEngine
    writer: object = None  # storage.writer.Writer
    upstream: object = None  # forward.Upstream
    # request headers never forwarded: our own API key is not the upstream's
    drop_headers: frozenset[bytes] = frozenset()
    services: tuple = ()  # started after the backend, stopped before it (the trainer)


async def _expire_loop(engine, older_than_s: float) -> None:
    """Forever: mark runs that were never rewarded as expired."""
    from rlproxy.storage import queries

    interval = max(1.0, min(older_than_s / 10.0, 60.0))
    while True:
        await asyncio.sleep(interval)
        try:
            n = await queries.expire_runs(engine, older_than_s)
            if n:
                logger.info("expired %d runs older than %g s without a reward", n, older_than_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("run expiry failed: %s", exc)


class ProxyApp(FastAPI):
    """FastAPI with the hot path and the key check in front of its own middleware stack.

    The completion routes are served by `routes_openai.HotPath` before FastAPI's stack (error
    middleware, telemetry, router), which costs more per request than the proxy's whole budget
    allows; the API key check wraps everything.
    """

    public_paths: tuple[str, ...] = ("/healthz",)

    def build_middleware_stack(self):
        from rlproxy.proxy import routes_openai

        state = self.state.proxy
        app = routes_openai.HotPath(super().build_middleware_stack(), state)
        if state.settings.api_key:
            app = APIKeyMiddleware(app, api_key=state.settings.api_key, public=self.public_paths)
        return app


def create_app(settings: Settings, backend: Backend, services: Sequence = ()) -> FastAPI:
    """The FastAPI app proxying to `backend`, capturing into `settings.db_url`, running `services`."""
    from rlproxy.storage import db

    db_url = db.normalize_url(settings.db_url)
    try:  # known before start() for the embedded engine; an attached server tells us on start()
        base_model = backend.served_model
    except Exception:
        base_model = settings.model
    state = ProxyState(
        settings=settings,
        backend=backend,
        policies=Policies(base_model, settings.model_map),
        gate=TrainGate(settings.blocking_train),
        drop_headers=frozenset({b"authorization"}) if settings.api_key else frozenset(),
        services=tuple(services),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from rlproxy.proxy.forward import Upstream, make_client
        from rlproxy.storage.writer import Writer

        state.gate.bind(asyncio.get_running_loop())
        await db.upgrade_async(db_url)
        state.engine = db.create_engine(db_url)
        state.writer = Writer(
            state.engine, flush_interval=settings.flush_interval, max_queue=settings.write_queue_max
        )
        state.metrics.attach_writer(state.writer)
        await state.writer.start()
        tasks: list[asyncio.Task] = []
        upstream = None
        started: list = []
        try:
            await backend.start()
            state.policies.set_base(backend.served_model)
            await state.policies.reload(backend, state.engine)
            timeout = settings.upstream_timeout
            upstream = Upstream(backend.base_url, timeout, make_client(timeout))
            state.upstream = upstream
            tasks.append(asyncio.create_task(state.policies.poll(state.engine), name="rlproxy-policy-poll"))
            tasks.append(
                asyncio.create_task(_expire_loop(state.engine, settings.run_expiry), name="rlproxy-expiry")
            )
            for service in services:
                await service.start()
                started.append(service)
            # Everything allocated so far (models, tokenizers, ORM metadata) lives for the whole
            # process: moving it out of the collector's reach keeps full collections from pausing
            # the event loop for tens of milliseconds under load (the p99 of every request).
            gc.freeze()
            logger.info("proxy ready: upstream %s, store %s", backend.base_url, db_url.split("://")[0])
            yield
        finally:
            for service in reversed(started):
                try:
                    await service.stop()
                except Exception:
                    logger.exception("stopping %r failed", service)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if upstream is not None:
                await upstream.aclose()
            try:
                await backend.stop()
            finally:
                await state.writer.close()
                await state.engine.dispose()

    app = ProxyApp(title="rlproxy", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.proxy = state
    app.state.policies = state.policies
    errors.install(app)

    from rlproxy.proxy import routes_openai, routes_runs

    app.include_router(routes_runs.router)
    public: tuple[str, ...] = ("/healthz",)
    try:
        from rlproxy.proxy import dashboard

        app.include_router(dashboard.router)
        public += tuple(dashboard.PUBLIC_PATHS)
    except ImportError:  # the dashboard is optional
        pass
    app.include_router(routes_openai.passthrough)
    app.public_paths = public
    return app
