"""The proxy's FastAPI app and its lifespan: `create_app(state)`.

The composition root (`rlproxy/compose.py`) builds the parts, includes the routers and puts the
ASGI layers around this app; here is what runs between start and stop. The lifespan owns every
resource and closes it in reverse order: the database (migrated to head on start), the writer
task, the backend (started or attached), the pooled upstream client, the background tasks (policy
poll, run expiry) and the root's services (the trainer). Route modules find all of it on
`app.state.proxy` (a `ProxyState`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.inference.backend import Backend
from rlproxy.proxy import apis, errors, hosted, upstreams
from rlproxy.proxy.forward import Upstream
from rlproxy.proxy.gate import TrainGate
from rlproxy.proxy.inflight import InFlight
from rlproxy.proxy.keys import KeyRing
from rlproxy.proxy.metrics import Metrics
from rlproxy.proxy.policies import Policies
from rlproxy.proxy.runstate import RunState
from rlproxy.proxy.upstreams import Upstreams
from rlproxy.settings import Settings
from rlproxy.storage import db, queries
from rlproxy.storage.journal import Journal, default_folder
from rlproxy.storage.writer import Writer

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
    engine: AsyncEngine = None  # type: ignore[assignment]  # set by the lifespan, before any request
    writer: Writer = None  # type: ignore[assignment]  # likewise
    upstream: Upstream | Upstreams = None  # type: ignore[assignment]  # one replica, or several
    # request headers never forwarded: the client's key is ours, not the upstream's (which
    # forward.Upstream sends itself: the backend's `api_key`)
    drop_headers: frozenset[bytes] = apis.DROP
    services: tuple = ()  # started after the backend, stopped before it (the trainer)
    runs: object = None  # proxy.runstate.RunState: which runs are closed (issue 22)
    busy: Callable[[], bool] = lambda: True  # requests coming? (`Limits.busy`): the loop-lag sampler's pace
    store_file: object = None  # storage.db.StoreFile: the SQLite file deleted or replaced? (issue 22)
    # policies on hosted, text-only upstreams (proxy/hosted.py): declared by the root, opened here
    hosted_specs: dict = field(default_factory=dict)
    hosted: object = None  # hosted.HostedUpstreams, or None when no policy is hosted
    keys: KeyRing = field(default_factory=KeyRing)  # the apps' keys (proxy/keys.py), read from the store


async def _expire_loop(engine, older_than_s: float) -> None:
    """Forever: mark runs that were never rewarded as expired."""
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


def _journal(settings: Settings, db_url: str):
    """The crash journal of this store (storage.journal.Journal), or None when it is off."""
    if settings.journal_dir == "off":
        return None
    folder = settings.journal_dir or default_folder(db_url, settings.cache_dir)
    return Journal(folder, max_bytes=settings.journal_max_bytes) if folder is not None else None


def create_app(state: ProxyState) -> FastAPI:
    """The FastAPI app whose lifespan opens and closes `state`'s resources (no routes: the root adds them)."""
    settings, backend, services = state.settings, state.backend, state.services
    db_url = db.normalize_url(settings.db_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.gate.bind(asyncio.get_running_loop())
        store_file = db.StoreFile(db_url)
        store_file.preflight()  # a read-only -shm would SIGBUS at the first write (issue 22)
        await db.upgrade_async(db_url)
        store_file.remember()
        state.store_file = store_file
        state.engine = db.create_engine(db_url)
        state.writer = Writer(
            state.engine,
            flush_interval=settings.flush_interval,
            max_queue=settings.write_queue_max,
            max_queue_bytes=settings.write_queue_max_bytes,
            journal=_journal(settings, db_url),
            process=settings.writer_process,
            idle_priority=settings.writer_idle_priority,
        )
        state.metrics.attach_writer(state.writer, settings.store_unhealthy_after)
        state.runs = RunState(state.engine, poll_interval=settings.run_state_poll_interval)
        state.metrics.attach_runs(state.runs)
        await state.writer.start()
        # Before serving: store what a killed predecessor's clients received but it never committed.
        await state.writer.recover(timeout=settings.store_unhealthy_after)
        await state.runs.load()  # the runs closed most recently: refused from the first turn on
        state.keys.engine = state.engine
        await state.keys.refresh()  # the apps' keys, before the first request (proxy/keys.py)
        tasks: list[asyncio.Task] = []
        upstream = None
        started: list = []
        try:
            await backend.start()
            state.policies.set_base(backend.served_model)
            await state.policies.reload(backend, state.engine)
            # one forward.Upstream, or upstreams.Upstreams over several replicas (`--upstream` repeated)
            upstream = await upstreams.open_upstream(
                backend.base_urls,
                settings,
                api_key=backend.api_key,  # the engine's secret, if it has one
                restore=upstreams.restorer(backend, state.engine),
            )
            state.upstream = upstream
            if state.hosted_specs:
                state.hosted = hosted.open_hosted(state.hosted_specs, settings)
            if isinstance(upstream, upstreams.Upstreams):
                state.metrics.attach_upstreams(upstream)
            poll = state.policies.poll(state.engine, settings.policy_poll_interval, backend)  # replicas
            tasks.append(asyncio.create_task(poll, name="rlproxy-policy-poll"))
            tasks.append(asyncio.create_task(state.metrics.watch_loop(state.busy), name="rlproxy-loop-lag"))
            tasks.append(
                asyncio.create_task(_expire_loop(state.engine, settings.run_expiry), name="rlproxy-expiry")
            )
            tasks.append(asyncio.create_task(state.runs.poll(), name="rlproxy-run-state"))
            tasks.append(asyncio.create_task(state.keys.poll(), name="rlproxy-keys"))
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
            if state.hosted is not None:
                await state.hosted.aclose()
            try:
                await backend.stop()
            finally:
                await state.writer.close()
                await state.engine.dispose()

    # no redirect_slashes: a redirect would answer a path the guard let through with another one
    app = FastAPI(
        title="rlproxy",
        lifespan=lifespan,
        # no /docs or /openapi.json: agents hold a key to the proxy, not a map of its routes (issue 22)
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    app.state.proxy = state
    errors.install(app)
    return app
