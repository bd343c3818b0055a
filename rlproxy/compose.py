"""The composition root: what `rlproxy serve` runs, each part built once, in order, and passed in.

    settings ─> backend ─> policies, train gate ─> trainer service ─> FastAPI app + routes ─> ASGI stack

The trainer is wired to the proxy here and nowhere else: it calls `policies.set_step` after it
publishes an adapter (the swap) and `gate.set_training` while a step trains. The store's engine
and writer, and the upstream client, are opened and closed by the app's lifespan
(`proxy/app.py`): they live exactly as long as the server does.

A request goes through the ASGI stack from the outside in:

    Limits   body size on every route, requests in flight              proxy/limits.py
    Guard    canonical path, Host, Origin, keys, content type           proxy/guard.py
    HotPath  the completion routes, forwarded and captured              proxy/routes_openai.py
    FastAPI  every other route (the routers included in `build_app`)    proxy/app.py

The CLI (`proxy/cli.py`) parses options into `Settings` and calls `build_app`; tests do the same.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

from rlproxy.inference.backend import Backend
from rlproxy.proxy import dashboard, routes_openai, routes_runs
from rlproxy.proxy.app import ProxyState, create_app
from rlproxy.proxy.auth import Principals
from rlproxy.proxy.gate import TrainGate
from rlproxy.proxy.guard import Guard, allowed_host_names, is_loopback
from rlproxy.proxy.limits import Limits
from rlproxy.proxy.policies import Policies
from rlproxy.settings import Settings

logger = logging.getLogger(__name__)

PUBLIC_PATHS: tuple[str, ...] = ("/healthz", *dashboard.PUBLIC_PATHS)  # served without a key


def make_backend(settings: Settings) -> Backend:
    """The inference backend the settings name (not started).

    `--upstream URL` always means "attach": any server speaking vLLM's API (vLLM itself, or
    `rlproxy engine`) is driven through VLLMBackend. Without it, `vllm` launches a vLLM server and
    `embedded` runs the in-process engine.

    The proxy->engine hop carries a key: a random per-process secret for an engine we start (it
    never leaves this process and the one we launch), `upstream_api_key` for one we attach to.
    """
    cache_dir = Path(settings.cache_dir).expanduser()
    if settings.backend == "vllm" or settings.upstream:
        from rlproxy.inference.vllm import VLLMBackend

        return VLLMBackend(
            settings.model,
            cache_dir=cache_dir,
            upstream=settings.upstream,
            python=settings.vllm_python,
            port=settings.engine_port,
            max_lora_rank=settings.max_lora_rank,
            extra_args=settings.vllm_args,
            startup_timeout=settings.vllm_startup_timeout,
            api_key=settings.upstream_api_key if settings.upstream else secrets.token_urlsafe(32),
        )
    from rlproxy.inference.embedded import EmbeddedBackend

    return EmbeddedBackend(
        settings.model,
        cache_dir=cache_dir,
        port=settings.engine_port,
        threads=settings.engine_threads,
        max_batch=settings.engine_max_batch,
        api_key=secrets.token_urlsafe(32),
    )


def trainer_config(settings: Settings) -> Any:
    """The TrainerConfig part of the settings (what is saved with every step)."""
    from rlproxy.trainer.config import TrainerConfig

    return TrainerConfig(**settings.model_dump(include=set(TrainerConfig.model_fields)))


def build_app(settings: Settings, backend: Backend | None = None) -> Limits:
    """The ASGI app `rlproxy serve` serves: backend, trainer and proxy, wired together.

    Its `.state.proxy` is the `ProxyState` every route shares (tests and tools read it there).
    """
    backend = backend if backend is not None else make_backend(settings)
    try:  # known before start() for the embedded engine; an attached server tells us on start()
        base_model = backend.served_model
    except Exception:
        base_model = settings.model
    policies = Policies(base_model, settings.model_map)
    gate = TrainGate(settings.blocking_train)

    services = []
    if settings.train:
        from rlproxy.storage.db import normalize_url
        from rlproxy.trainer.service import TrainerService

        services.append(
            TrainerService(
                trainer_config(settings),
                normalize_url(settings.db_url),
                backend,
                on_publish=policies.set_step,  # the swap: new requests go to the published adapter
                on_train_state=gate.set_training,  # hold new requests while a step trains (if set)
            )
        )
    state = ProxyState(
        settings=settings, backend=backend, policies=policies, gate=gate, services=tuple(services)
    )

    api = create_app(state)
    # The hot routes are not here: `HotPath` (below) serves them before FastAPI sees the request,
    #   POST /v1/chat/completions, POST /v1/completions, and both under /runs/{run_id}/v1/...
    #   (routes_openai.complete: forward + capture).
    api.include_router(routes_runs.router)  # rewards, runs, training steps, /healthz, /metrics
    api.include_router(dashboard.router)  # GET / and its scripts
    api.include_router(routes_openai.passthrough)  # any other /v1/* path, relayed untouched

    principals = Principals(settings.api_key, settings.admin_key, public=PUBLIC_PATHS)
    if principals.open and not is_loopback(settings.host):
        logger.warning(
            "listening on %s without RLPROXY_API_KEY or RLPROXY_ADMIN_KEY: whoever reaches it can "
            "use it, read every run and feed the trainer (see README, Security)",
            settings.host,
        )
    asgi = Limits(
        Guard(
            routes_openai.HotPath(api, state),
            principals,
            allowed_hosts=allowed_host_names(settings.allowed_hosts, settings.host),
            cors_origins=tuple(o.strip() for o in settings.cors_origins.split(",") if o.strip()),
        ),
        settings.max_body_bytes,
        settings.max_reward_body_bytes,
        settings.max_concurrent_requests,
    )
    asgi.state = api.state  # type: ignore[attr-defined]  # the routes' shared state: `.state.proxy`
    return asgi
