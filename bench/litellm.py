"""LiteLLM's proxy as the comparison point for bench/proxy.py: a plain OpenAI passthrough to the stub.

A user who wants their agent's traffic logged would most likely put LiteLLM's proxy in front of
vLLM, so that is what rlproxy is measured against. This module starts it from its own venv
(`make litellm` builds `.venv-litellm` with `pip install 'litellm[proxy]'`) on a loopback port,
configured to be fair to it — everything it would do per request beyond forwarding is off where
the config allows, so the figure is its floor, not a strawman:

- one model entry `openai/<model>` with `api_base` = the stub, nothing else in the router;
- no database (no `DATABASE_URL`): no spend logs, no key lookups, no writes at all;
- no callbacks (`success_callback`, `failure_callback`, `callbacks` all empty), no alerting,
  no background health checks, no cache, no guardrails, telemetry off, the model-cost map read
  from the package (no fetch at start), log level ERROR, JSON logs off;
- `LITELLM_MASTER_KEY` is required by the proxy; the client sends it as `Authorization: Bearer`.
  Without a database the key is compared in memory (no lookup cost).

What it still does per request, and cannot be switched off from config: its auth and budget
middleware, its router (deployment selection, retries bookkeeping), its in-memory logging object
(`Logging` with the standard-logging payload, built for every call even with no callback), its
provider transformation (request → OpenAI SDK call → response object → JSON). `LOGGING` below is
what bench/proxy.py prints next to the figures, so a reader knows what LiteLLM stored: nothing.

    from bench.litellm import LiteLLM
    with LiteLLM(upstream="http://127.0.0.1:9100") as lite:
        ... POST f"{lite.url}/v1/chat/completions" with lite.headers ...
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
LITELLM_BIN = ROOT / ".venv-litellm" / "bin" / "litellm"
MASTER_KEY = "sk-rlproxy-bench"

# What LiteLLM was doing besides forwarding, as configured by `config()` and `env()` below.
LOGGING: dict[str, object] = {
    "database": None,  # no DATABASE_URL: no spend logs, no request rows, nothing stored
    "callbacks": [],  # success_callback / failure_callback / callbacks: none
    "spend_logs": False,
    "background_health_checks": False,
    "alerting": None,
    "cache": False,
    "telemetry": False,  # LITELLM_TELEMETRY_DISABLED=true
    "log_level": "ERROR",  # LITELLM_LOG; no per-request access log (uvicorn access log off)
    "workers": 1,
    "server": "uvicorn (LiteLLM's default)",
    "rows_stored": 0,
    # always on, no setting removes them: built in to every call even with no callback configured
    "per_request_builtins": "auth + budget checks in memory, parallel-request limiter, router usage"
    " counters, Logging object with the standard logging payload and a cost calculation",
}


def version() -> str:
    """The installed LiteLLM version, read from the venv's package metadata (no import of litellm)."""
    py = LITELLM_BIN.parent / "python"
    out = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def config(upstream: str, model: str) -> dict:
    """The proxy config: one passthrough deployment, every optional per-request feature off."""
    return {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"openai/{model}",
                    "api_base": upstream.rstrip("/") + "/v1",
                    "api_key": "none",
                },
            }
        ],
        "litellm_settings": {
            "success_callback": [],
            "failure_callback": [],
            "callbacks": [],
            "cache": False,
            "set_verbose": False,
            "json_logs": False,
            "drop_params": False,
            "num_retries": 0,
            "request_timeout": 60,
        },
        "router_settings": {"num_retries": 0, "routing_strategy": "simple-shuffle"},
        "general_settings": {
            "master_key": MASTER_KEY,
            "disable_spend_logs": True,
            "disable_error_logs": True,
            "background_health_checks": False,
            "store_model_in_db": False,
            "disable_reset_budget": True,
        },
    }


def env() -> dict[str, str]:
    """The process environment: our key, no database, nothing fetched from the network at start."""
    e = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_HOST", "REDIS_URL")}
    e.update(
        {
            "LITELLM_MASTER_KEY": MASTER_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the price table at start
            "LITELLM_TELEMETRY_DISABLED": "true",
            "LITELLM_LOG": "ERROR",
            "LITELLM_MODE": "PRODUCTION",  # do not read a .env file
            "DISABLE_SCHEMA_UPDATE": "true",
        }
    )
    return e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiteLLM:
    """LiteLLM's proxy in its own process on a loopback port; `start()` waits until it answers."""

    def __init__(
        self,
        upstream: str,
        model: str = "stub-model",
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if not LITELLM_BIN.exists():
            raise FileNotFoundError(f"{LITELLM_BIN} is missing: run `make litellm` first")
        self.upstream = upstream
        self.model = model
        self.extra_args = extra_args  # e.g. ("--run_granian",): other servers LiteLLM can run on
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {MASTER_KEY}"}
        self.proc: subprocess.Popen | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="rlproxy-bench-litellm-"))
        self._log = self._dir / "litellm.log"

    def start(self, timeout: float = 120.0) -> LiteLLM:
        # JSON is valid YAML, so the config needs no yaml package on our side.
        cfg = self._dir / "config.yaml"
        cfg.write_text(json.dumps(config(self.upstream, self.model), indent=1))
        cmd = [
            str(LITELLM_BIN),
            "--config",
            str(cfg),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--num_workers",
            "1",
            *self.extra_args,
        ]
        with self._log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=env(), stdout=out, stderr=subprocess.STDOUT, cwd=self._dir)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Ready = a real chat completion through it succeeds (its health routes answer earlier)."""
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"litellm exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                r = httpx.post(
                    f"{self.url}/v1/chat/completions", json=body, headers=self.headers, timeout=10.0
                )
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"litellm did not come up in {timeout:g} s (last: {last}):\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> LiteLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
