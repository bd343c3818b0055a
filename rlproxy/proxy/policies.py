"""Policy routing: which model the upstream serves for a request's `model`.

A policy is a name the app uses for "the model I'm training": the backend's base model name (the
default policy), any policy named in the model map, or any policy with a published step. The
proxy rewrites `model` to the current adapter `{policy}@{step}` (the base model before step 1).
`{policy}@{step}` in the request pins a step. The model map (`gpt-4o-mini=agent,*=agent`) serves apps
that hard-code another model name. Any other name is a 404 here, with a message saying how to map
it, rather than a round trip that the upstream would answer with a less helpful 404.

Policies live on different upstreams: a text-only policy (`text_only`, from `hosted_upstreams`:
proxy/hosted.py) is served by its hosted provider, never has steps, and its upstream model is the
provider's name for it (`hosted_models`, else the client's `model` as written). The others are the
backend's. The model map moves an app between them: `gpt-4o-mini=teacher` today,
`gpt-4o-mini=student` once the student is good enough.

Steps move forward in three ways: the in-process trainer calls `set_step` after it publishes, a
poll of `training_steps` every `policy_poll_interval` seconds picks up steps published by another
process (`rlproxy train`, or the replica that holds the trainer's lock), and on start the newest
adapter of each policy is loaded into the (possibly fresh) backend again. The poll loads a new step's
adapter into this replica's backend before it serves it: an embedded engine is this process's own,
and loading into a vLLM the trainer already loaded it into is a cheap in-place reload. It reads the
checkpoint folder the step's row names, so every replica must see the trainer's `checkpoint_dir`
at the same path (shared storage). An adapter that cannot be loaded is not served: the policy stays
on its step, and the next poll tries again.
"""

from __future__ import annotations

import asyncio
import logging

from rlproxy.errors import APIError, ConfigError, RLProxyError
from rlproxy.inference.backend import adapter_name, parse_adapter_name
from rlproxy.storage import queries

logger = logging.getLogger(__name__)


def pairs(spec: str, what: str, error: type[Exception] = ConfigError) -> dict[str, str]:
    """`"a=x,b=y"` -> {"a": "x", "b": "y"}; `error` naming the setting `what` on a malformed entry."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise error(f"{what}: entry {item!r} is not name=value")
        out[key.strip()] = value.strip()
    return out


def parse_model_map(spec: str) -> dict[str, str]:
    """`"a=p,b=q,*=p"` -> {"a": "p", "b": "q", "*": "p"}; raises ValueError on a malformed entry."""
    return pairs(spec, "model_map", ValueError)


class Policies:
    """The current step of every policy, and the rewrite of a request's `model`."""

    def __init__(
        self, base_model: str, model_map: str = "", text_only: dict[str, str | None] | None = None
    ) -> None:
        self.base_model = base_model
        self.default = base_model
        self.model_map = parse_model_map(model_map)
        # policy -> the model its hosted provider is asked for (None: the client's `model` as written)
        self.text_only: dict[str, str | None] = dict(text_only or {})
        self.steps: dict[str, int] = {}
        self._failed: dict[str, int] = {}  # policy -> step whose adapter failed to load (warned once)
        self._known = {base_model, *self.model_map.values(), *self.text_only}
        self.router = None  # proxy/rollout.py Router: canary policies split their runs (None: immediate)

    def set_base(self, base_model: str) -> None:
        """The backend's base model name, known once it started (it is also the default policy)."""
        self._known.discard(self.base_model)
        self.base_model = self.default = base_model
        self._known.add(base_model)

    def known(self, policy: str) -> bool:
        """Whether `policy` names a policy this proxy serves."""
        return policy in self._known or policy in self.steps

    def step(self, policy: str) -> int:
        """Current step of `policy` (0 = base model)."""
        return self.steps.get(policy, 0)

    def upstream_model(self, policy: str, step: int) -> str:
        """The model name the upstream serves for `policy` at `step`."""
        return adapter_name(policy, step) if step > 0 else self.base_model

    def resolve(self, model: object, run_id: str | None = None) -> tuple[str, int, str]:
        """(policy, step, upstream model) for a request's `model` (of run `run_id`: a canary routes by
        it); APIError 404 if it names nothing."""
        if model is None:
            policy = self.default
        elif not isinstance(model, str):
            raise APIError(422, "model: must be a string", param="model", code="invalid_type")
        else:
            mapped = self.model_map.get(model)
            if mapped is not None:
                policy = mapped
            elif self.known(model):
                policy = model
            else:
                pinned = parse_adapter_name(model)
                if pinned is not None and self.known(pinned[0]) and pinned[0] not in self.text_only:
                    name, step = pinned
                    return name, step, self.upstream_model(name, step)
                policy = self.model_map.get("*")  # type: ignore[assignment]
                if policy is None:
                    raise APIError(
                        404,
                        f"The model `{model}` does not exist. This proxy serves the policies "
                        f"{sorted(self._known | set(self.steps))}; to serve an app that asks for "
                        f"`{model}`, set RLPROXY_MODEL_MAP='{model}=<policy>' (or '*=<policy>').",
                        type="invalid_request_error",
                        param="model",
                        code="model_not_found",
                    )
        if policy in self.text_only:  # a hosted provider's: no steps, its own model name
            return policy, 0, self.text_only[policy] or (model if isinstance(model, str) else policy)
        step = self.steps.get(policy, 0)
        if self.router is not None:
            step = self.router.route(policy, step, run_id)
        return policy, step, self.upstream_model(policy, step)

    async def set_step(self, policy: str, step: int) -> None:
        """Serve `policy@step` from now on (the trainer calls this after publishing)."""
        if step != self.steps.get(policy):
            logger.info("policy %s now serves step %d", policy, step)
        self.steps[policy] = step

    def advance(self, latest: dict[str, tuple[int, str]]) -> None:
        """Move each policy forward to the newest step in `latest` (policy -> (step, path))."""
        for policy, (step, _path) in latest.items():
            if step > self.steps.get(policy, 0):
                logger.info("policy %s now serves step %d (published by another process)", policy, step)
                self.steps[policy] = step

    async def reload(self, backend, engine) -> None:
        """Load each policy's newest adapter into `backend` and serve it (after a restart)."""
        latest = await queries.latest_adapters(engine)
        for policy, (step, path) in latest.items():
            try:
                await backend.load_adapter(adapter_name(policy, step), path)
            except (RLProxyError, OSError) as exc:
                logger.warning("could not re-load adapter %s@%d from %s: %s", policy, step, path, exc)
                continue
            self.steps[policy] = step
            logger.info("re-loaded adapter %s@%d from %s", policy, step, path)

    async def catch_up(self, latest: dict[str, tuple[int, str]], backend=None) -> None:
        """Serve the newest step in `latest` of each policy that moved on, once its adapter is loaded
        into `backend` (None: only flip, the upstream has it already)."""
        for policy, (step, path) in latest.items():
            if step <= self.steps.get(policy, 0):
                continue
            if backend is not None:
                try:
                    await backend.load_adapter(adapter_name(policy, step), path)
                except (RLProxyError, OSError) as exc:
                    if self._failed.get(policy) != step:
                        logger.warning(
                            "policy %s stays on step %d: cannot load step %d from %s (%s); retrying",
                            policy,
                            self.steps.get(policy, 0),
                            step,
                            path,
                            exc,
                        )
                    self._failed[policy] = step
                    continue
            self._failed.pop(policy, None)
            if step > self.steps.get(policy, 0):  # the in-process trainer may have flipped it meanwhile
                logger.info("policy %s now serves step %d (published by another process)", policy, step)
                self.steps[policy] = step

    async def poll(self, engine, interval: float = 1.0, backend=None) -> None:
        """Forever, every `interval` seconds: pick up steps published by another process, loading their
        adapters into `backend` first (run as a lifespan task)."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.catch_up(await queries.latest_adapters(engine), backend)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a locked or briefly unreachable DB must not end the poll
                logger.debug("policy poll failed: %s", exc)
