"""The one settings object. Every field reads `RLPROXY_<NAME>`; CLI options override it.

The README's configuration table is generated from this class (a test keeps them in sync).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlproxy.trainer.config import TrainerConfig


class Settings(BaseSettings, TrainerConfig):
    """rlproxy's configuration: server, backend, store, capture and (inherited) trainer fields."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_", extra="ignore")

    # --- server ---
    host: str = Field("127.0.0.1", description="address the proxy listens on")
    port: int = Field(8000, ge=0, le=65535, description="port the proxy listens on (0 = any free port)")
    api_key: str | None = Field(
        None,
        description="agents' key: if set, the OpenAI routes, rewards and `GET /v1/runs/{id}` need "
        "`Authorization: Bearer <key>` (see Security)",
    )
    # --- security ---
    admin_key: str | None = Field(
        None,
        description="operators' key: all runs, stats, training steps, /metrics, the dashboard's data; "
        "also valid wherever the agents' key is (see Security)",
    )
    upstream_api_key: str | None = Field(
        None, description="bearer key sent to an attached upstream (`--upstream`); clients' keys never are"
    )
    allowed_hosts: str = Field(
        "",
        description="comma list of Host names served (no port; `*` = any); empty = localhost, 127.0.0.1, "
        "[::1] when bound to loopback, else any (421 otherwise)",
    )
    cors_origins: str = Field(
        "", description="comma list of browser origins (`https://app.example:8080`, `*`) allowed cross-origin"
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="largest request body accepted on any route, bytes (413 above)"
    )
    # --- limits (HTTP layer: every route, before any handler) ---
    max_reward_body_bytes: int = Field(
        64 * 1024, ge=1024, description="largest body of `POST /v1/runs/{id}/reward`, bytes (413 above)"
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="largest request line + headers, bytes (431 and close above)"
    )
    max_headers: int = Field(100, ge=8, description="most request headers (431 and close above)")
    max_json_depth: int = Field(
        64, ge=2, le=200, description="deepest nesting of a JSON request body, levels (400 above)"
    )
    header_timeout: float = Field(
        10.0, gt=0, description="seconds from a request's first byte until its headers are in (408, close)"
    )
    body_timeout: float = Field(
        60.0, gt=0, description="seconds from a request's headers until its whole body is in (408, close)"
    )
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="seconds an idle connection (new or between requests) is kept open"
    )
    max_connections: int = Field(
        2048, ge=1, description="open client connections; requests on more get 503 + Retry-After, then close"
    )
    max_concurrent_requests: int = Field(
        1024, ge=1, description="requests in flight (streams included); more get 503 + Retry-After"
    )
    backlog: int = Field(2048, ge=1, description="connections the kernel queues before they are accepted")
    sql_timeout: float = Field(
        30.0, gt=0, description="seconds a `rlproxy sql` statement may run before it is interrupted"
    )
    # --- inference backend ---
    backend: Literal["embedded", "vllm"] = Field("embedded", description="inference server behind the proxy")
    model: str = Field(
        "smollm2-135m", description="built-in name (smollm2-135m, tiny) or a Hugging Face model folder"
    )
    upstream: str | None = Field(
        None,
        description="URL of a running OpenAI-compatible server to attach to; several (`--upstream` "
        "repeated, or a comma list) are replicas of one model: runs stick to one, adapters go to all "
        "(see Several inference upstreams)",
    )
    upstream_timeout: float = Field(
        600.0, gt=0, description="seconds to wait for the upstream's answer (504 after)"
    )
    cache_dir: str = Field("~/.cache/rlproxy", description="where prepared built-in models are cached")
    engine_port: int = Field(
        0, ge=0, le=65535, description="loopback port of the embedded engine (0 = any free)"
    )
    engine_threads: int | None = Field(
        None, ge=1, description="torch threads of the embedded engine; None = default"
    )
    engine_max_batch: int = Field(16, ge=1, description="most sequences the embedded engine decodes together")
    vllm_python: str = Field(
        "python", description="python executable that has vLLM (e.g. .venv-vllm/bin/python)"
    )
    vllm_args: str = Field("", description="extra arguments for the launched vLLM server")
    vllm_startup_timeout: float = Field(
        300.0, gt=0, description="seconds to wait for a launched vLLM's /health"
    )
    max_lora_rank: int = Field(8, ge=1, description="largest LoRA rank the backend must accept")
    # --- upstream client ---
    upstream_idle_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds an upstream answer may send nothing between chunks before it is cut"
        " (stored as an error, the client's stream ended)",
    )
    upstream_max_connections: int = Field(
        256, ge=1, description="most open connections to the upstream (count); more requests wait for one"
    )
    # --- several upstreams (replicas) ---
    upstream_affinity: Literal["least_loaded", "hash"] = Field(
        "least_loaded",
        description="how a new run picks its replica: `least_loaded` (fewest requests in flight, "
        "remembered per run) or `hash` (rendezvous hash of the run id: the same replica from every proxy)",
    )
    upstream_sticky_runs: int = Field(
        100_000, ge=1, description="runs whose replica is remembered (least_loaded; oldest forgotten first)"
    )
    upstream_probe_interval: float = Field(
        2.0, gt=0, description="seconds between health probes (`GET /health`) of each replica"
    )
    upstream_retry_max: float = Field(
        30.0,
        gt=0,
        description="longest wait, seconds, between probes of an ejected replica (doubling from "
        "upstream_probe_interval)",
    )
    # --- store ---
    db_url: str = Field(
        "sqlite+aiosqlite:///rlproxy.db", description="SQLAlchemy URL (or a SQLite file path)"
    )
    flush_interval: float = Field(
        0.05, ge=0, description="seconds the writer waits to batch rows into one commit"
    )
    write_queue_max: int = Field(
        10_000, ge=1, description="uncommitted completions after which new requests wait for the store"
    )
    # --- capture durability ---
    write_queue_max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1,
        description="bytes of uncommitted completions (request + response + tokens) after which new "
        "requests wait for the store",
    )
    store_wait_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds a request waits for room in the write queue, or a reward for its run's "
        "streams and commit, before 503 + Retry-After",
    )
    store_unhealthy_after: float = Field(
        30.0, gt=0, description="seconds without a commit while work waits, after which /healthz says 503"
    )
    journal_dir: str | None = Field(
        None,
        description="folder of the crash journal (completions appended before their last byte is sent, "
        "replayed on start); default `<db file>.journal`, or under cache_dir for PostgreSQL; `off` disables",
    )
    journal_max_bytes: int = Field(
        1024 * 1024 * 1024,
        ge=4096,
        description="largest crash journal, bytes (records past it are not journaled)",
    )
    run_expiry: float = Field(
        86400.0, gt=0, description="seconds after which an unrewarded open run is expired"
    )
    # --- policies ---
    model_map: str = Field(
        "", description="comma list `name=policy` or `*=policy` for apps that hard-code a model"
    )
    policy_poll_interval: float = Field(
        1.0,
        gt=0,
        description="seconds between two looks for steps published by another process (the trainer "
        "of another replica, `rlproxy train`): its adapter is loaded here, then served",
    )
    # --- trainer (plus the inherited TrainerConfig fields) ---
    train: bool = Field(True, description="run the trainer inside `serve`")
    blocking_train: bool = Field(
        False, description="hold new requests while a step trains (single-GPU memory)"
    )
    init_adapter: str | None = Field(
        None,
        description="LoRA folder (peft format) the default policy and the model map's policies start from "
        "when they have no step yet: it becomes their step 1 (kind init; see Start and fork)",
    )
    nproc: int = Field(
        0,
        ge=0,
        le=1024,
        description="`rlproxy train`: ranks on this machine, one step's groups split across them "
        "(torch.distributed.run; NCCL on CUDA, one GPU each, else gloo); 0 = one process, no launcher",
    )
    # --- judge rewards (trainer/judge.py; README: Judge rewards) ---
    judge: Literal["off", "missing", "always"] = Field(
        "missing",
        description="which groups an LLM judge scores: missing = groups holding a run completed without "
        "a reward (`POST /v1/runs/{id}/complete`; every run of such a group is then judged), always = "
        "every group (the app's numbers kept in `metrics.app_reward`), off = none (`/complete` is a 409)",
    )
    judge_policies: str = Field(
        "", description="comma list `policy=off|missing|always` overriding `judge` for those policies"
    )
    judge_base_url: str | None = Field(
        None,
        description="OpenAI-compatible base URL of the judge (`http://host/v1`); None = the proxy's own "
        "upstream, called directly (judge calls are never captured)",
    )
    judge_model: str | None = Field(
        None, description="model the judge asks for; None = the upstream's served base model"
    )
    judge_api_key: str | None = Field(
        None, description="bearer key for `judge_base_url`; None = the upstream's key when it is the judge"
    )
    judge_rubric: str | None = Field(
        None, description="rubric for every policy; None = the built-in one (judge_prompt.py DEFAULT_RUBRIC)"
    )
    judge_rubrics: dict[str, str] = Field(
        default_factory=dict,
        description='per-policy rubrics, JSON `{"policy": "rubric"}`; the complete body\'s `rubric` wins',
    )
    judge_max_attempts: int = Field(
        3, ge=1, le=10, description="judge calls per group before malformed output marks it failed"
    )
    judge_max_tokens: int = Field(1024, ge=16, description="max_tokens of a judge call")
    judge_temperature: float = Field(
        0.0, ge=0, le=2, description="temperature of a judge call (a retry samples at >= 0.7)"
    )
    judge_timeout: float = Field(120.0, gt=0, description="seconds a judge call may take")
    judge_max_chars: int = Field(
        4000, ge=200, description="characters of each trajectory shown to the judge (the end is kept)"
    )
    # --- embedded engine: prefix cache, completion cap (issues 21, 22; docs/engine.md) ---
    engine_prefix_cache_bytes: int = Field(
        512 * 2**20,
        ge=0,
        description="bytes of KV the embedded engine keeps for prompts and completions it has seen (LRU, "
        "per adapter), so a run's next call prefills only its new tokens; 0 = off",
    )
    engine_default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="completion tokens of a chat request that sets no max_tokens; None = 1024 on the "
        "embedded engine and vLLM's own (the rest of the context) on a launched vLLM, which gets a set "
        "value as `--override-generation-config`",
    )

    # --- rollout (issue 28; docs/rollout.md) ---
    rollout: str = Field(
        "immediate",
        description="how a new step goes live: immediate (every run at once) or canary (a share of new "
        "runs until a test on their reward promotes or rolls it back); per policy: agent=canary,*=immediate",
    )
    canary_fraction: float = Field(
        0.2, gt=0, lt=1, description="share of new runs (0-1, by run id) a candidate step serves in a canary"
    )
    canary_min_runs: int = Field(
        30, ge=2, description="rewarded runs per arm before the first look; look k at k x this many"
    )
    canary_looks: int = Field(4, ge=1, le=20, description="looks at most; each spends canary_alpha / looks")
    canary_alpha: float = Field(
        0.05, gt=0, lt=0.5, description="false-promote (and false-rollback) bound over all looks, 0-1"
    )
    canary_min_pairs: int = Field(
        10, ge=2, description="groups with runs on both arms for the paired test (fewer: Welch's test)"
    )
    canary_error_margin: float = Field(
        0.05,
        ge=0,
        le=1,
        description="error-rate excess (5xx or cut at length; absolute, 0-1) that rolls back on errors alone",
    )
    canary_inconclusive: Literal["rollback", "promote"] = Field(
        "rollback", description="what the last look decides when neither test is significant"
    )

    @field_validator("rollout")
    @classmethod
    def _rollout_modes(cls, value: str) -> str:
        from rlproxy.storage.rollout_rule import parse_modes

        parse_modes(value)  # a ValueError names the bad entry
        return value

    # --- tenancy (issue 22) ---
    run_state_poll_interval: float = Field(
        1.0,
        gt=0,
        le=60,
        description="seconds between two reads of the runs closed (rewarded) on any replica: a turn "
        "for a closed run is refused (409 run_closed) at most this long after another replica's reward",
    )
    reward_bound: float = Field(
        1e6,
        gt=0,
        le=1e12,
        description="largest reward magnitude accepted: a reward outside [-bound, bound] is a 422 "
        "(keeps a step's advantages finite)",
    )

    # --- hosted upstreams (issue 25) ---
    hosted_upstreams: str = Field(
        "",
        description="policies served by a hosted, text-only upstream: comma list `policy=URL` (e.g. "
        "`teacher=https://api.openai.com/v1`); their requests go as the client wrote them (only `model` "
        "mapped), rows are stored with token ids NULL and source `hosted` (SFT data, never GRPO samples)",
    )
    hosted_models: str = Field(
        "",
        description="model name each hosted upstream is asked for: comma list `policy=model` (e.g. "
        "`teacher=gpt-4o-mini`); a policy not listed gets the client's `model` as written",
    )
    hosted_api_keys: str = Field(
        "",
        description="per hosted upstream, the environment variable holding its key: comma list "
        "`policy=ENV_NAME`; a policy not listed sends `upstream_api_key`",
    )

    # --- a newcomer's first hour (issue 26) ---
    dashboard_port: int = Field(
        8100,
        ge=0,
        le=65535,
        description="port `rlproxy dashboard` listens on (0 = any free port); `serve` has the dashboard "
        "on its own port at `/`",
    )

    @field_validator("upstream", mode="before")
    @classmethod
    def _upstream_list(cls, value: object) -> object:
        """A list of URLs (repeated `--upstream`) or a comma list -> one comma list; empty -> None."""
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        if isinstance(value, str):
            value = ",".join(u.strip() for u in value.split(",") if u.strip()) or None
        return value

    @property
    def upstream_urls(self) -> list[str]:
        """The attached upstreams, one URL per replica (empty: none attached)."""
        return self.upstream.split(",") if self.upstream else []


def settings_markdown() -> str:
    """The README's configuration table, generated from `Settings` (a test keeps the README in sync)."""
    rows = ["| setting | environment variable | default | what it does |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default if field.default_factory is None else field.default_factory()
        default_text = ", ".join(default) if isinstance(default, list) else default
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | `RLPROXY_{name.upper()}` | `{default_text}` | {description} |")
    return "\n".join(rows)
