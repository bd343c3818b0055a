"""The one settings object. Every field reads `RLPROXY_<NAME>`; CLI options override it.

The fields are written in groups, one class per concern (server, security, limits, engine, upstream,
hosted, store, runs, policies, training, trainer, judge, rollout, siblings, traces: `GROUPS`), and
`Settings` inherits them all, so every name stays flat (`settings.judge_model`,
`RLPROXY_JUDGE_MODEL`) while a part that needs one concern is handed its group:
`settings.group(JudgeSettings)` for the judge, `settings.group(TrainerConfig)` for the trainer
(what is saved with every step).

This module is below everything and imports nothing of ours: the trainer's group lives here, and
`trainer/config.py` builds its `TrainerConfig` on it (the trainer reads the settings, the settings
never read the trainer); the parsers of setting strings that validators check (`report_to`,
`rollout`) live here too. docs/configuration.md's tables are `settings_markdown()`, one per group
(a test keeps them in sync).

This file is over 400 lines because it is the one place every setting is written, with its units:
each group is a short class, and splitting them into files would only scatter the one list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The tracker names that `report_to` accepts (trainer/reporting.py sends to them), here because the
# setting's validator needs them and the settings import nothing of the trainer's.
TRACKERS: dict[str, str] = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
}  # name -> module
LossKind = Literal["grpo", "dr_grpo", "dapo", "gspo"]  # the policy-gradient losses (trainer/losses.py)


def parse_report_to(value: str | None) -> list[str]:
    """The tracker names of a comma list ("tensorboard,wandb"); ValueError for an unknown one."""
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker(s) {unknown}; report_to takes {', '.join(TRACKERS)}")
    return list(dict.fromkeys(names))


def parse_rollout(spec: str) -> dict[str, str]:
    """The `rollout` setting -> {policy or "*": mode}: `"canary"` = {"*": "canary"};
    `"agent=canary,*=immediate"` per policy. Raises ValueError on an unknown mode or a bad entry."""
    out: dict[str, str] = {}
    for item in (spec or "immediate").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, mode = item.rpartition("=") if "=" in item else ("*", "=", item)
        name, mode = name.strip(), mode.strip()
        if not sep or not name or mode not in ("immediate", "canary"):
            raise ValueError(f"rollout entry {item!r}: want immediate, canary or policy=immediate|canary")
        out[name] = mode
    return out


class ServerSettings(BaseModel):
    """Server: where the proxy and the dashboard listen."""

    host: str = Field("127.0.0.1", description="address the proxy listens on")
    port: int = Field(8000, ge=0, le=65535, description="port the proxy listens on (0 = any free port)")
    dashboard_port: int = Field(
        8100,
        ge=0,
        le=65535,
        description="port `rlproxy dashboard` listens on (0 = any free port); `serve` has the dashboard "
        "on its own port at `/`",
    )


class SecuritySettings(BaseModel):
    """Security: keys, Host names and browser origins (docs/security.md)."""

    api_key: str | None = Field(
        None,
        description="agents' key: if set, the OpenAI routes, rewards and `GET /v1/runs/{id}` need "
        "`Authorization: Bearer <key>` (see Security)",
    )
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
    disclose_policy_step: bool = Field(
        False,
        description="send agents the `X-Policy-Step` header (the step that served them); off: only the "
        "operator sees steps, and no app can tell a canary's arms apart",
    )


class LimitsSettings(BaseModel):
    """Limits: the HTTP layer's bounds: every route, before any handler (docs/security.md, Limits)."""

    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="largest request body accepted on any route, bytes (413 above)"
    )
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


class EngineSettings(BaseModel):
    """Engine: the inference backend behind the proxy (docs/engine.md)."""

    backend: Literal["embedded", "vllm"] = Field("embedded", description="inference server behind the proxy")
    model: str = Field(
        "smollm2-135m", description="built-in name (smollm2-135m, tiny) or a Hugging Face model folder"
    )
    cache_dir: str = Field("~/.cache/rlproxy", description="where prepared built-in models are cached")
    engine_port: int = Field(
        0, ge=0, le=65535, description="loopback port of the embedded engine (0 = any free)"
    )
    engine_threads: int | None = Field(
        None, ge=1, description="torch threads of the embedded engine; None = default"
    )
    engine_max_batch: int = Field(16, ge=1, description="most sequences the embedded engine decodes together")
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
    vllm_python: str = Field(
        "python", description="python executable that has vLLM (e.g. .venv-vllm/bin/python)"
    )
    vllm_args: str = Field("", description="extra arguments for the launched vLLM server")
    vllm_startup_timeout: float = Field(
        300.0, gt=0, description="seconds to wait for a launched vLLM's /health"
    )
    max_lora_rank: int = Field(8, ge=1, description="largest LoRA rank the backend must accept")


class UpstreamSettings(BaseModel):
    """Upstream: the client of the upstream, and several upstreams (replicas)."""

    upstream: str | None = Field(
        None,
        description="URL of a running OpenAI-compatible server to attach to; several (`--upstream` "
        "repeated, or a comma list) are replicas of one model: runs stick to one, adapters go to all "
        "(see Several inference upstreams)",
    )
    upstream_timeout: float = Field(
        600.0, gt=0, description="seconds to wait for the upstream's answer (504 after)"
    )
    upstream_idle_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds an upstream answer may send nothing between chunks before it is cut"
        " (stored as an error, the client's stream ended)",
    )
    max_stream_event_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="largest event of an upstream's stream, bytes: one not ended within it cuts the "
        "stream (502, stored as an error) instead of growing the relay's buffer",
    )
    upstream_max_connections: int = Field(
        256, ge=1, description="most open connections to the upstream (count); more requests wait for one"
    )
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


class HostedSettings(BaseModel):
    """Hosted: policies served by hosted, text-only upstreams (issue 25)."""

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


class StoreSettings(BaseModel):
    """Store: the database, the writer and capture durability."""

    data_dir: str = Field(
        ".",
        description="folder of the state `serve` keeps: the SQLite store `rlproxy.db` (with its crash "
        "journal and lock files beside it) and `checkpoints/`, unless db_url or checkpoint_dir say "
        "otherwise; created on start",
    )
    db_url: str = Field(
        "rlproxy.db", description="SQLite file path (in data_dir) or SQLAlchemy URL (postgresql://...)"
    )
    flush_interval: float = Field(
        0.05, ge=0, description="seconds the writer waits to batch rows into one commit"
    )
    writer_process: bool = Field(
        True,
        description="write the store from a process of its own: the serving process only journals "
        "and sends, so SQL never holds its interpreter lock while requests wait (a database file or "
        "server; an in-memory SQLite database is written in-process)",
    )
    writer_idle_priority: bool | None = Field(
        None,
        description="run the writer process at the scheduler's idle priority (Linux SCHED_IDLE): a "
        "request never waits behind a batch's SQL for a core (tagged c=1 p99 ~5.4 -> ~3.6 ms on 2 "
        "cores, docs/performance.md). A writer that starves there (a trainer or an engine keeping "
        "every core busy) goes to the normal priority within ~2 s, and back to idle a minute later "
        "(longer each time it starves again). Unset: on in front "
        "of vLLM, off with the embedded engine (it decodes in this process, keeping the cores busy); "
        "no effect with writer_process=false",
    )
    write_queue_max: int = Field(
        10_000, ge=1, description="uncommitted completions after which new requests wait for the store"
    )
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


class RunsSettings(BaseModel):
    """Runs: runs and rewards across replicas (issue 22)."""

    run_expiry: float = Field(
        86400.0, gt=0, description="seconds after which an unrewarded open run is expired"
    )
    run_state_poll_interval: float = Field(
        1.0,
        gt=0,
        le=60,
        description="seconds between two reads of the runs closed (rewarded) on any replica, and "
        "checks of the runs this replica saw first since the last (no store read on a request): a "
        "turn for a closed run is refused (409 run_closed) at most this long after another "
        "replica's reward",
    )
    reward_bound: float = Field(
        1e6,
        gt=0,
        le=1e12,
        description="largest reward magnitude accepted: a reward outside [-bound, bound] is a 422 "
        "(keeps a step's advantages finite)",
    )


class PolicySettings(BaseModel):
    """Policies: which policy serves a request, and steps published elsewhere."""

    model_map: str = Field(
        "", description="comma list `name=policy` or `*=policy` for apps that hard-code a model"
    )
    policy_poll_interval: float = Field(
        1.0,
        gt=0,
        description="seconds between two looks for steps published by another process (the trainer "
        "of another replica, `rlproxy train`): its adapter is loaded here, then served",
    )


class TrainingSettings(BaseModel):
    """Training: where and how the trainer runs (not saved with steps)."""

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


class TrainerSettings(BaseModel):
    """Trainer: what a GRPO step needs, saved with every step and checkpoint (trainer/config.py)."""

    # which runs make a step
    group_size: int = Field(4, ge=2, description="completed runs that make a group ready")
    groups_per_step: int = Field(1, ge=1, description="ready groups taken by one optimizer step")
    group_timeout: float = Field(
        600.0, gt=0, description="seconds after a group's newest run when it is ready with >= 2 runs"
    )
    # live traffic: runs still alone in their group group_timeout after their reward (status `ungrouped`)
    singletons: Literal["ungrouped", "train"] = Field(
        "ungrouped",
        description="runs alone in their group past group_timeout become status `ungrouped`; train = "
        "then train them in batches, each run's advantage against its batch's mean reward (REINFORCE++)",
    )
    singleton_batch: int = Field(
        16,
        ge=2,
        description="ungrouped runs of one policy per step with singletons=train (>= 2 are taken once the "
        "newest has waited another group_timeout)",
    )
    # advantages and loss
    loss: LossKind = Field("grpo", description="policy-gradient loss")
    scale_rewards: Literal["group", "none"] = Field(
        "group", description="divide advantages by the group's reward std (group) or not (none)"
    )
    epsilon: float | None = Field(
        None,
        ge=0,
        description="lower clip range of the importance ratio; None = the loss's default "
        "(0.2; gspo 3e-4, its sequence ratio moves far less than a token's)",
    )
    epsilon_high: float | None = Field(
        None,
        ge=0,
        description="upper clip range; None = epsilon when it is set, else the loss's default "
        "(0.2; dapo 0.28 clip-higher; gspo 4e-4)",
    )
    ratio_cap: float | None = Field(
        3.0,
        gt=1,
        description="dual-clip bound C: a negative-advantage token's loss stops growing at ratio C "
        "(stale or mismatched samples cannot take C x the gradient); None = off",
    )
    max_policy_lag: int | None = Field(
        8,
        ge=0,
        description="samples drawn more than this many adapter steps ago are not trained on (counted "
        "batch/stale; a step left with none marks its runs skipped); None = no limit",
    )
    sampling_logprobs: Literal["raw", "processed"] = Field(
        "raw",
        description="what the backend's stored logprobs are: raw = log_softmax(logits), vLLM's default "
        "and the embedded engine's; processed = after temperature (vLLM --logprobs-mode processed_logprobs)",
    )
    overlong_filter: bool = Field(
        False, description="leave out samples cut by max_tokens or max_seq_len (DAPO's overlong filtering)"
    )
    beta: float = Field(
        0.0, ge=0, description="KL penalty weight against the base model; 0 = no KL, no ref pass"
    )
    max_seq_len: int = Field(
        2048, ge=16, description="tokens per sample; longer samples are truncated and counted"
    )
    # LoRA and optimizer
    lora_r: int = Field(8, ge=1, description="LoRA rank")
    lora_alpha: int = Field(16, ge=1, description="LoRA alpha (scale = alpha / r)")
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="LoRA dropout (the base model's dropout is always off while training)"
    )
    lora_target_modules: list[str] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="module names that get LoRA weights",
    )
    learning_rate: float | None = Field(
        None,
        gt=0,
        description="AdamW learning rate; None = by model size, 1e-3 x (576 / hidden_size) ** 0.75: 1e-3 for "
        "SmolLM2-135M, 3.9e-4 for Qwen2.5-3B (see README, Training)",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient-norm clip")
    micro_batch_size: int = Field(8, ge=1, description="rows (segments) per forward/backward at most")
    micro_batch_tokens: int | None = Field(
        1024,  # directory shape, SmolLM2-135M fp32: peak RSS 2.9 GB at 1024, 4.7 GB at 2048 (bench)
        ge=16,
        description="padded token positions per forward/backward at most (rows x longest row; a longer "
        "row runs alone): bounds activation memory; None = micro_batch_size alone",
    )
    merge_calls: bool = Field(
        True,
        description="merge a run's calls token-exactly into segments (a call whose prompt extends the "
        "previous prompt + sampled ids is appended); false = one sample per call (docs/training-segments.md)",
    )
    loss_weighting: Literal["run", "per_call"] = Field(
        "run",
        description="what a loss's 'sequence' is: run = one trajectory (GRPO's o_i), per_call = each call "
        "(the behaviour before merged segments)",
    )
    completion_budget: int | None = Field(
        None,
        ge=1,
        description="dr_grpo's constant normalizer, in sampled tokens per run; None = the step's largest "
        "sum of a run's requested max_tokens (loss_weighting=per_call: max_seq_len)",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: less memory, slower (prompts not shared)"
    )
    train_autocast: Literal["off", "auto", "bf16"] = Field(
        "off",
        description="CPU: the decoder body's matmuls in bf16 (torch.autocast; the LoRA weights, optimizer, "
        "LM head and log-softmax stay fp32); auto = when the CPU has native bf16 (AVX512-BF16 or AMX), "
        "off = fp32 throughout (see docs/training.md for what it measured). CUDA trains bf16 weights "
        "either way",
    )
    share_base_weights: bool = Field(
        True,
        description="a trainer in the embedded engine's process puts its LoRA on the engine's own base "
        "weights (one copy in memory) instead of loading them again",
    )
    seed: int = Field(0, description="torch seed of the trainer")
    # checkpoints and publishing
    checkpoint_dir: str = Field(
        "checkpoints", description="folder holding {policy}/step-NNNN/ checkpoints (in data_dir)"
    )
    keep_checkpoints: int = Field(
        3, ge=1, description="newest checkpoints kept on disk (and adapters served)"
    )
    keep_best: bool = Field(
        True,
        description="also keep the checkpoint whose adapter scored the best mean reward on validation runs "
        "(X-Split: val; the `validation` view), however old",
    )
    val_min_runs: int = Field(
        1, ge=1, description="validation runs an adapter step needs before it can be the best checkpoint"
    )
    unload_grace: float = Field(
        30.0, ge=0, description="seconds an old adapter stays loaded after a newer one"
    )
    poll_interval: float = Field(1.0, gt=0, description="seconds between looks for ready groups")
    train_threads: int | None = Field(
        None, ge=1, description="torch threads for training; None = torch's default"
    )
    # where each step's metrics also go (training_steps always has them); see trainer/reporting.py
    report_to: str = Field(
        "",
        description="comma list of trackers that also get each step's metrics: tensorboard, wandb, mlflow "
        "(pip install 'rlproxy[tensorboard]', ...); empty = the database only",
    )
    metrics_log_dir: str = Field(
        "logs", description="folder of TensorBoard event files ({dir}/{policy}/) and W&B's local files"
    )

    @field_validator("report_to")
    @classmethod
    def _known_trackers(cls, value: str) -> str:
        return ",".join(parse_report_to(value))


class JudgeSettings(BaseModel):
    """Judge: judge rewards (trainer/judge.py; docs: Judge rewards)."""

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


class RolloutSettings(BaseModel):
    """Rollout: how a new step goes live (issue 28; docs/rollout.md)."""

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
    canary_max_key_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="most of an arm's runs one app key may make (0-1; 1 = no cap): its runs beyond that "
        "share are left out of the arm (docs/rollout.md)",
    )

    @field_validator("rollout")
    @classmethod
    def _rollout_modes(cls, value: str) -> str:
        parse_rollout(value)  # a ValueError names the bad entry
        return value


class SiblingSettings(BaseModel):
    """Siblings: the proxy samples more answers to a stored prompt and scores them (docs/siblings.md)."""

    siblings: str = Field(
        "off",
        description="which calls get siblings: off, or a comma list of new (a share of new calls, right "
        "after the app has its answer), alone (the calls of a rewarded run left alone in its group), "
        "plateau (the calls of a group skipped for equal rewards), imported (the prompts rlproxy import "
        "stored, answered by the serving adapter); per policy: agent=new,*=off",
    )
    siblings_k: int = Field(4, ge=2, le=16, description="answers in a sibling group, the app's own included")
    siblings_share: float = Field(
        1.0, ge=0, le=1, description="share of the eligible calls branched (0-1, by completion id)"
    )
    siblings_temperature: float | None = Field(
        None, ge=0, le=2, description="exploration temperature of siblings; None = the call's own"
    )
    siblings_calls_per_run: int = Field(
        2, ge=1, description="calls of one run branched at most (alone, plateau): its first ones"
    )
    siblings_max_inflight: int = Field(
        1, ge=1, description="sibling requests in flight at once on the engine"
    )
    siblings_max_share: float = Field(
        0.5, gt=0, le=1, description="share of wall time sibling requests may keep the engine busy (0-1)"
    )
    siblings_queue: int = Field(
        256, ge=1, description="calls waiting to be branched at most; more are dropped and counted"
    )
    siblings_weight: float = Field(
        1.0, ge=0, description="weight of a sibling group's runs in a step, against 1 for an app run group"
    )
    scorer: Literal["checks", "url", "judge"] = Field(
        "checks",
        description="what scores a sibling group: checks (built in: tool calls that parse and fit the "
        "offered schemas, JSON asked by response_format, not cut by max_tokens), url (the app's "
        "scorer_url), judge (the judge model, candidates side by side)",
    )
    scorer_url: str | None = Field(
        None,
        description="the app's scorer: POST {messages, tools, candidates, ...} -> {scores: [K numbers]} "
        "(docs/siblings.md)",
    )
    scorer_api_key: str | None = Field(None, description="bearer key sent to scorer_url")
    scorer_timeout: float = Field(30.0, gt=0, description="seconds a scorer call may take")
    scorer_max_attempts: int = Field(
        3, ge=1, le=10, description="scorer calls per group before a failure marks it failed"
    )
    scorer_max_bytes: int = Field(
        1_048_576, ge=1024, description="largest scorer answer body read, bytes (larger: a failed call)"
    )
    scorer_checks_weight: float = Field(
        0.0, ge=0, le=1, description="share of the built-in checks in a url or judge score (partial credit)"
    )
    shadow_prompts: int = Field(
        0,
        ge=0,
        description="shadow check: stored prompts a new step and the serving step both answer before the "
        "step serves anyone (0 = off)",
    )
    shadow_margin: float = Field(
        0.05, ge=0, description="the candidate may lose by at most this mean score (else rolled back: shadow)"
    )


# (section, group) in the docs' order; `Settings` inherits them all.


class TracesSettings(BaseModel):
    """Traces: every call sent live as an OpenTelemetry GenAI span to an OTLP endpoint (docs/traces.md)."""

    otlp_endpoint: str = Field(
        "",
        description="OTLP/HTTP endpoint the calls go to as spans (protobuf), e.g. `http://localhost:6006` "
        "(Phoenix) or `https://cloud.langfuse.com/api/public/otel`; `/v1/traces` is appended unless the "
        "URL ends with it; empty = off",
    )
    otlp_headers: str = Field(
        "",
        description="comma list of `name=value` headers sent with each export (auth), values "
        "percent-decoded, as `OTEL_EXPORTER_OTLP_HEADERS`",
    )
    otlp_capture_content: bool = Field(
        False,
        description="include the messages and tool definitions in the spans (`gen_ai.input.messages`, "
        "...); off: model, usage and ids only, as the GenAI conventions ask",
    )
    otlp_queue_max: int = Field(
        2048, ge=1, description="spans waiting for export past which new ones are dropped (and counted)"
    )
    otlp_batch_size: int = Field(512, ge=1, description="most spans in one export request")
    otlp_interval: float = Field(
        2.0, gt=0, description="seconds between exports (sooner when a batch is full)"
    )
    otlp_timeout: float = Field(
        10.0,
        gt=0,
        description="seconds one export request may take; also what shutdown waits to send the rest",
    )


GROUPS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("server", ServerSettings),
    ("security", SecuritySettings),
    ("limits", LimitsSettings),
    ("engine", EngineSettings),
    ("upstream", UpstreamSettings),
    ("hosted", HostedSettings),
    ("store", StoreSettings),
    ("runs", RunsSettings),
    ("policies", PolicySettings),
    ("training", TrainingSettings),
    ("trainer", TrainerSettings),
    ("judge", JudgeSettings),
    ("rollout", RolloutSettings),
    ("siblings", SiblingSettings),
    ("traces", TracesSettings),
)

Group = TypeVar("Group", bound=BaseModel)


class Settings(
    TracesSettings,
    SiblingSettings,
    RolloutSettings,
    JudgeSettings,
    TrainerSettings,
    TrainingSettings,
    PolicySettings,
    RunsSettings,
    StoreSettings,
    HostedSettings,
    UpstreamSettings,
    EngineSettings,
    LimitsSettings,
    SecuritySettings,
    ServerSettings,
    BaseSettings,
):
    """rlproxy's configuration: every group's fields, flat (bases listed last group first, so that
    pydantic, which collects the fields of the last base first, keeps the docs' order)."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_", extra="ignore")

    @model_validator(mode="after")
    def _in_data_dir(self) -> Settings:
        """The store and the checkpoints go in data_dir unless given apart (as paths relative to it)."""
        if self.data_dir not in ("", "."):
            if "db_url" not in self.model_fields_set:
                self.db_url = str(Path(self.data_dir).expanduser() / self.db_url)
            if "checkpoint_dir" not in self.model_fields_set:
                self.checkpoint_dir = str(Path(self.data_dir).expanduser() / self.checkpoint_dir)
        return self

    def group(self, cls: type[Group]) -> Group:
        """The fields of one group (or of a class built on one, like `TrainerConfig`) as that class, taken
        as they are: the settings were validated as a whole (a `model_copy(update=...)` past a bound,
        as a test forcing a refusal does, stays what it was set to)."""
        return cls.model_construct(**self.model_dump(include=set(cls.model_fields)))


def settings_markdown() -> str:
    """docs/configuration.md's tables, one per group, generated from the settings (a test keeps them)."""
    parts = []
    for section, cls in GROUPS:
        what = (cls.__doc__ or "").split(": ", 1)[-1].strip()
        rows = [
            f"### {section}",
            "",
            what[:1].upper() + what[1:],
            "",
            "| setting | environment variable | default | what it does |",
            "|---|---|---|---|",
        ]
        for name, field in cls.model_fields.items():
            default = field.default if field.default_factory is None else field.default_factory()
            default_text = ", ".join(default) if isinstance(default, list) else default
            description = (field.description or "").replace("|", "\\|")
            rows.append(f"| `{name}` | `RLPROXY_{name.upper()}` | `{default_text}` | {description} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)
