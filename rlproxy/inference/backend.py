"""The one seam between rlproxy and an inference server.

Both backends (the embedded transformers engine and vLLM) expose the same OpenAI-compatible HTTP
API at `base_url` (routes under `/v1/...`, plus vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`). The proxy forwards to `base_url`; the trainer publishes adapters with
`load_adapter` (trainer/publish.py, the one door). Neither can tell the backends apart: every
member a caller uses is declared here. One capability only the embedded engine has is a protocol
of its own (`SharesWeights`: its base weights, for a trainer in the same process).

An adapter is served under the name `{policy}@{step}`: the trainer publishes it under that name and
the proxy routes a policy's requests to it. `adapter_name` builds it and `parse_adapter_name` reads
it, for both.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


def adapter_name(policy: str, step: int) -> str:
    """The model name step `step` of `policy` is served under: `{policy}@{step}`."""
    return f"{policy}@{step}"


def parse_adapter_name(model: str) -> tuple[str, int] | None:
    """(policy, step) of a `{policy}@{step}` name, or None when `model` is not one."""
    policy, at, step = model.rpartition("@")
    # ASCII digits only (`"²".isdigit()` is True, `int("²")` raises), and a step a 64-bit column holds
    ok = at and step.isascii() and step.isdigit() and len(step) < 19
    return (policy, int(step)) if ok else None


@runtime_checkable
class Backend(Protocol):
    """An OpenAI-compatible inference server that can load LoRA adapters at run time."""

    @property
    def base_url(self) -> str:
        """Root URL without `/v1`, e.g. `http://127.0.0.1:8001`. Valid after `start()`."""
        ...

    @property
    def base_urls(self) -> tuple[str, ...]:
        """Every replica's root URL (`base_url` first); one unless several upstreams were attached."""
        ...

    @property
    def api_key(self) -> str | None:
        """The bearer key every call to the server must carry (None: the server is open)."""
        ...

    @property
    def served_model(self) -> str:
        """The base model's name as the server reports it in `/v1/models` (the default policy)."""
        ...

    @property
    def model_path(self) -> str:
        """Local folder of the base model's weights and tokenizer (the trainer loads the same)."""
        ...

    async def start(self) -> None:
        """Start (or attach to) the server and return once `health()` is true; raises BackendUnavailable."""
        ...

    async def stop(self) -> None:
        """Stop the server if we started it (children included); idempotent."""
        ...

    async def health(self) -> bool:
        """True when the server answers its health route."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter saved in folder `path` as model `name` (replacing one of that name)."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`; raises AdapterError(status=404) if it is not loaded."""
        ...

    async def load_adapters_into(self, url: str, adapters: dict[str, str] | None = None) -> None:
        """Give replica `url` (one of `base_urls`, back after an outage) every adapter the backend
        serves, plus `adapters` (name -> folder), before it takes traffic again."""
        ...


@runtime_checkable
class SharesWeights(Protocol):
    """A backend whose model lives in this process (the embedded engine): a trainer here can put its
    LoRA on the same base weight tensors instead of loading a second copy."""

    async def shared_base(self) -> Any:
        """A module tree of the base model whose parameters are the backend's own tensors."""
        ...
