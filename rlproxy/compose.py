"""The composition root: what `rlproxy serve` runs, each part built once, in order, and passed in.

    settings ─> backend ─> policies, train gate ─> trainer service ─> FastAPI app + routes ─> ASGI stack

The trainer is wired to the proxy here and nowhere else: it calls `policies.set_step` after it
publishes an adapter (the swap) and `gate.set_training` while a step trains. With `init_adapter`,
an `InitAdapter` service starts before it (policies without steps start from that LoRA, step 1).
The store's engine and writer, and the upstream client, are opened and closed by the app's
lifespan (`proxy/app.py`): they live exactly as long as the server does.

A request goes through the ASGI stack from the outside in:

    ErrorShapes  error answers in a wire API's shape (Anthropic's)      proxy/apis.py
    Limits   body size on every route, requests in flight              proxy/limits.py
    Guard    canonical path, Host, Origin, keys, content type           proxy/guard.py
    HotPath  the completion routes, forwarded and captured              proxy/routes_openai.py
    FastAPI  every other route (the routers included in `build_app`)    proxy/app.py

This module only builds and wires parts. The processes that run them (uvicorn for `serve` and
`rlproxy dashboard`, the trainer process, torchrun's ranks, `sft`, `fork`) are the command line's,
in `rlproxy/cli/processes.py`; tests call `build_app` the same way.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from rlproxy.inference.backend import Backend
from rlproxy.inference.vllm import VLLMBackend
from rlproxy.proxy import (
    dashboard,
    errors,
    routes_keys,
    routes_models,
    routes_openai,
    routes_rollouts,
    routes_runs,
    routes_untagged,
)
from rlproxy.proxy.apis import ErrorShapes
from rlproxy.proxy.app import ProxyState, create_app
from rlproxy.proxy.auth import Principals
from rlproxy.proxy.gate import TrainGate
from rlproxy.proxy.guard import Guard, allowed_host_names, is_loopback
from rlproxy.proxy.hosted import parse_hosted, provider_models
from rlproxy.proxy.limits import Limits
from rlproxy.proxy.metrics import Metrics
from rlproxy.proxy.policies import Policies, parse_model_map
from rlproxy.proxy.rollout import RolloutService, Router
from rlproxy.settings import JudgeSettings, LimitsSettings, Settings, TracesSettings, parse_rollout
from rlproxy.storage import queries
from rlproxy.storage.db import normalize_url
from rlproxy.trainer import resample, scorers
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.judge import Judge
from rlproxy.trainer.rollout import controller_from
from rlproxy.trainer.shadow import ShadowChecker
from rlproxy.trainer.siblings import SiblingService

logger = logging.getLogger(__name__)


def make_backend(settings: Settings) -> Backend:
    """The inference backend the settings name (not started).

    `--upstream URL` always means "attach": any server speaking vLLM's API (vLLM itself, or
    `rlproxy engine`) is driven through VLLMBackend. Without it, `vllm` launches a vLLM server and
    `embedded` runs the in-process engine. Several URLs (`--upstream` repeated) are replicas of one
    model: the backend loads adapters into each, the lifespan forwards over `proxy/upstreams.py`.

    The proxy->engine hop carries a key: a random per-process secret for an engine we start (it
    never leaves this process and the one we launch), `upstream_api_key` for one we attach to.
    """
    cache_dir = Path(settings.cache_dir).expanduser()
    if settings.backend == "vllm" or settings.upstream:
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
            default_max_tokens=settings.engine_default_max_tokens,
        )
    from rlproxy.inference.embedded import DEFAULT_MAX_TOKENS, EmbeddedBackend  # lazy: torch

    return EmbeddedBackend(
        settings.model,
        cache_dir=cache_dir,
        port=settings.engine_port,
        threads=settings.engine_threads,
        max_batch=settings.engine_max_batch,
        api_key=secrets.token_urlsafe(32),
        prefix_cache_bytes=settings.engine_prefix_cache_bytes,
        default_max_tokens=settings.engine_default_max_tokens or DEFAULT_MAX_TOKENS,
    )


def _direct(backend: Backend, path: str = "") -> Callable[[], tuple[str, str, str | None]]:
    """The backend's (base URL + `path`, served model, key), asked once it has started: the judge
    and the shadow check call the backend directly, never through the proxy's capture."""
    return lambda: (f"{backend.base_url}{path}", backend.served_model, backend.api_key)


def make_judge(
    settings: JudgeSettings, backend: Backend, metrics: Any = None, always: bool = False
) -> Judge | None:
    """The judge the trainer asks before it selects groups (trainer/judge.py), built from the
    settings' judge group (`settings.group(JudgeSettings)`), or None when it is off for every
    policy (`always`: built all the same, for the siblings' `scorer=judge`). Its default endpoint is
    the backend itself, so judge calls are never training data (`_direct`)."""
    judge = Judge(
        settings,
        resolve=_direct(backend, "/v1"),
        on_call=metrics.judge_call if metrics is not None else None,
        on_group=metrics.judge_group if metrics is not None else None,
    )
    return None if judge.off and not always else judge


def make_shadow(settings: Settings, backend: Backend) -> Any:
    """The shadow check a new step passes before it serves (trainer/shadow.py), or None when
    `shadow_prompts` is 0. It samples the backend itself (`_direct`) and scores with the configured
    scorer (trainer/scorers.py)."""
    if not settings.shadow_prompts:
        return None
    return ShadowChecker(
        prompts=settings.shadow_prompts,
        margin=settings.shadow_margin,
        make_scorer=lambda client: scorers.build_scorer(settings, client),  # looked up per check (tests)
        resolve=_direct(backend),
        max_attempts=settings.scorer_max_attempts,
        retry_after=settings.scorer_timeout,
    )


def _hosted_specs(settings: Settings) -> dict[str, Any]:
    """The policies served by hosted, text-only upstreams (proxy/hosted.py), by policy."""
    return parse_hosted(
        settings.hosted_upstreams, settings.hosted_models, settings.hosted_api_keys, settings.upstream_api_key
    )


async def init_adapter(settings: Settings, backend: Backend, default_policy: str) -> list[str]:
    """`--init-adapter DIR`: DIR becomes step 1 of each policy without steps (trainer/offline.py):
    the default policy and the model map's, but a hosted provider's (it has no adapter to start),
    loaded into `backend`; returns the policies started."""
    from rlproxy.trainer.offline import init_policies  # lazy: torch

    assert settings.init_adapter is not None
    hosted = _hosted_specs(settings)
    names = dict.fromkeys([default_policy, *parse_model_map(settings.model_map).values()])
    return await init_policies(
        normalize_url(settings.db_url),
        settings.group(TrainerConfig),
        [p for p in names if p not in hosted],
        settings.init_adapter,
        backend.model_path,
        settings.max_lora_rank,
        backend=backend,
    )


def canary_router(settings: Settings, policies: Policies, metrics: Metrics) -> Any:
    """The canary router's lifespan service (proxy/rollout.py), hooked into `policies` and `/metrics`;
    None when every policy is in immediate mode (routing exactly as without rollouts)."""
    modes = parse_rollout(settings.rollout)
    if "canary" not in modes.values():
        return None
    router = Router(modes)
    policies.router = router
    metrics.registry.register(router)
    return RolloutService(router, None, settings.policy_poll_interval)


def sibling_service(
    settings: Settings, backend: Backend, policies: Policies, hosted_specs: dict[str, Any], metrics: Metrics
) -> Any:
    """The siblings service (trainer/siblings.py), or None when `siblings` is off: it samples more
    answers to stored calls and scores them, paced against the app's requests in flight (`Limits`),
    on the backend directly (never through the proxy's capture), with the engine priority only where
    it is honoured: the embedded engine always, a launched vLLM only under `--scheduling-policy priority`
    (vLLM refuses a priority otherwise), an attached server never."""
    if settings.siblings.strip() in ("", "off"):
        return None
    launched = not settings.upstream and "priority" in settings.vllm_args  # a vLLM we start with it
    honoured = launched or not isinstance(backend, VLLMBackend)

    def serving(policy: str) -> tuple[str, int]:
        step = policies.step(policy)
        return policies.upstream_model(policy, step), step

    return SiblingService(
        settings,
        normalize_url(settings.db_url),
        backend,
        serving=serving,
        hosted=frozenset(hosted_specs),
        priority=resample.SIBLING_PRIORITY if honoured else None,
        poll_interval=settings.poll_interval,  # the trainer's: how often the store is read
        metrics=metrics,
        judge=make_judge(settings.group(JudgeSettings), backend, metrics, always=True)
        if settings.scorer == "judge"
        else None,
    )


def make_trainer(settings: Settings, backend: Backend, metrics: Metrics | None = None, **hooks: Any) -> Any:
    """The trainer service (trainer/service.py) of `serve` and `rlproxy train`, with its judge,
    canary controller and shadow check; `hooks`: what its process wires in (`serve`: the swap and
    the train gate; rank 0 of `train --nproc N`: `train_fn`)."""
    from rlproxy.trainer.service import TrainerService  # lazy: torch

    return TrainerService(
        settings.group(TrainerConfig),  # what is saved with every step
        normalize_url(settings.db_url),
        backend,
        judge=make_judge(settings.group(JudgeSettings), backend, metrics),  # before each selection
        rollouts=controller_from(settings),  # canary rollouts (trainer/rollout.py); None: immediate
        siblings_weight=settings.siblings_weight,  # sibling groups' runs in a step
        shadow=make_shadow(settings, backend),  # a new step's check before it serves (trainer/shadow.py)
        **hooks,
    )


class InitAdapter:
    """A service started before the trainer: `init_adapter`, then the started policies served at step 1."""

    def __init__(self, settings: Settings, backend: Backend, policies: Policies) -> None:
        self.settings, self.backend, self.policies = settings, backend, policies

    async def start(self) -> None:
        for policy in await init_adapter(self.settings, self.backend, self.policies.default):
            await self.policies.set_step(policy, 1)

    async def stop(self) -> None:
        return None


def build_app(settings: Settings, backend: Backend | None = None) -> ErrorShapes:
    """The ASGI app `rlproxy serve` serves: backend, trainer and proxy, wired together. Its
    `.state.proxy` is the `ProxyState` every route shares (tests and tools read it there)."""
    backend = backend if backend is not None else make_backend(settings)
    if settings.writer_idle_priority is None:  # unset: idle when the engine is a server of its own
        idle = isinstance(backend, VLLMBackend) and settings.writer_process  # (the embedded one
        settings = settings.model_copy(update={"writer_idle_priority": idle})  # decodes in this process)
    elif settings.writer_idle_priority and not settings.writer_process:
        logger.warning(
            "writer_idle_priority has no effect with writer_process=false: the writer thread runs in "
            "the serving process, whose priority it does not lower"
        )
    try:  # known before start() for the embedded engine; an attached server tells us on start()
        base_model = backend.served_model
    except Exception:
        base_model = settings.model
    hosted_specs = _hosted_specs(settings)  # policies on hosted providers (text only)
    policies = Policies(base_model, settings.model_map, provider_models(hosted_specs))
    gate = TrainGate(settings.blocking_train)
    metrics = Metrics()
    if hasattr(backend, "metrics_collector"):  # the embedded engine's prefix cache and counters
        metrics.registry.register(backend.metrics_collector())

    rollout = canary_router(settings, policies, metrics)  # proxy/rollout.py; None: every policy immediate
    # before the trainer: its first step continues the initial adapter
    init = InitAdapter(settings, backend, policies) if settings.init_adapter else None
    trainer = None
    if settings.train:
        trainer = make_trainer(
            settings,
            backend,
            metrics,
            on_publish=policies.set_step,  # the swap: new requests go to the published adapter
            on_train_state=gate.set_training,  # hold new requests while a step trains (if set)
        )
        if rollout is not None and trainer.rollouts is not None:  # routed by a decision once written
            trainer.rollouts.on_decision = rollout.refresh
    siblings = sibling_service(settings, backend, policies, hosted_specs, metrics)
    spans = None  # every call as an OTLP span (traces/otlp_live.py): first in, last out, on /metrics
    if settings.otlp_endpoint:
        from rlproxy.traces.otlp_live import OtlpExporter  # lazy: the traces extra

        spans = OtlpExporter(settings.group(TracesSettings), lambda: state.writer, metrics.registry)
    services = tuple(s for s in (spans, rollout, init, trainer, siblings) if s is not None)  # in order
    state = ProxyState(
        settings=settings,
        backend=backend,
        policies=policies,
        gate=gate,
        metrics=metrics,
        services=services,
        hosted_specs=hosted_specs,
    )
    metrics.registry.register(state.keys)  # requests, tokens and refusals per app key
    if rollout is not None:
        rollout.state = state

    api = create_app(state)
    # The hot routes are not here: `HotPath` (below) serves them before FastAPI sees the request,
    #   POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, all under
    #   /runs/{run_id}/v1/... too (routes_openai.complete: forward + capture), and the rewards
    #   (routes_runs.reward_route: POST .../reward and .../complete).
    api.include_router(routes_runs.router)  # runs, training steps, /healthz, /metrics
    api.include_router(routes_untagged.router)  # untagged requests: listed, rewarded by reply id
    api.include_router(routes_keys.router)  # GET /v1/admin/keys: the apps' keys and their use
    api.include_router(routes_models.router)  # GET /v1/models by name, never the server's paths
    api.include_router(dashboard.router)  # GET / and its scripts
    api.include_router(routes_rollouts.router)  # GET /rollouts (canary panel) and its data (issue 28)
    api.include_router(routes_openai.passthrough)  # any other /v1/* path, relayed untouched

    principals = Principals(settings.api_key, settings.admin_key, keys=state.keys)
    if principals.open and not is_loopback(settings.host):
        logger.warning(
            "listening on %s without RLPROXY_API_KEY or RLPROXY_ADMIN_KEY: whoever reaches it can "
            "use it, read every run and feed the trainer (see README, Security)",
            settings.host,
        )
    limits = _front(routes_openai.HotPath(api, state), principals, settings)
    state.busy = limits.busy  # the loop-lag sampler slows down while no request comes
    if siblings is not None:  # siblings wait (a while) while the app has requests in flight
        siblings.budget.app_busy = lambda: limits.in_flight > 0
    # the Messages routes answer errors in Anthropic's shape, refusals included
    asgi = ErrorShapes(limits)
    asgi.state = api.state  # type: ignore[attr-defined]  # the routes' shared state: `.state.proxy`
    return asgi


def build_readonly_app(settings: Settings) -> Limits:
    """What `rlproxy dashboard` serves: the dashboard on the store at `settings.db_url`, read-only.

    No model, no trainer, no OpenAI routes and no writer: the page, its scripts and the GET routes
    it reads (the same functions `serve` routes), on an engine the database
    itself refuses writes on (`queries.open_readonly`). Any other path is 404, any other method
    405. The admin key, Host and Origin checks are `serve`'s (`Guard`).
    """
    db_url = normalize_url(settings.db_url)
    state = ProxyState(settings=settings, backend=None, policies=Policies(""), gate=TrainGate(False))  # type: ignore[arg-type]

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.engine = await queries.open_readonly(db_url, statement_timeout_s=settings.sql_timeout)
        try:
            state.policies.steps = {
                p: step for p, (step, _path) in (await queries.latest_adapters(state.engine)).items()
            }
            logger.info("read-only dashboard on %s", db_url.split("://")[0])
            yield
        finally:
            await state.engine.dispose()

    api = FastAPI(
        title="rlproxy (read-only)", lifespan=lifespan, docs_url=None, redoc_url=None, redirect_slashes=False
    )
    api.state.proxy = state
    errors.install(api)
    for path, route in (  # the read routes the page calls
        ("/v1/runs", routes_runs.list_runs),
        ("/v1/runs/stats", routes_runs.run_stats),  # before /v1/runs/{run_id}
        ("/v1/runs/{run_id}", routes_runs.get_run),
        ("/v1/training/steps", routes_runs.training_steps),
    ):
        api.add_api_route(path, route, methods=["GET"])
    api.add_api_route("/v1/admin/untagged", routes_untagged.list_untagged, methods=["GET"])

    async def healthz() -> dict[str, str]:
        return {"status": "ok", "mode": "read-only"}

    api.add_api_route("/healthz", healthz, methods=["GET"])
    api.include_router(dashboard.router)
    # With an admin key every data route needs it (agents have no business here: their routes get
    # a key no one holds); without one everything is open, on loopback only unless allowed_hosts.
    agent_key = secrets.token_urlsafe(32) if settings.admin_key else None
    principals = Principals(agent_key, settings.admin_key)
    asgi = _front(api, principals, settings)
    asgi.state = api.state  # type: ignore[attr-defined]
    return asgi


def _front(app, principals: Principals, settings: Settings) -> Limits:
    """What every request meets before `app`: the limits (body size, requests in flight), then the
    guard (keys, allowed hosts, CORS)."""
    return Limits(
        Guard(
            app,
            principals,
            allowed_hosts=allowed_host_names(settings.allowed_hosts, settings.host),
            cors_origins=tuple(o.strip() for o in settings.cors_origins.split(",") if o.strip()),
        ),
        settings.group(LimitsSettings),
    )
