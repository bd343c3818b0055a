"""The `rlproxy` command line: it parses options into `Settings` and calls the composition root.

Options that set a setting are made from the settings object (`options.setting`): their help,
environment variable and default are the field's, the same as the README's table. A user's mistake
(a bad option, a missing database, bad SQL) ends with one `error: ...` line and a non-zero exit
(`options.CleanErrors`); `rlproxy --debug ...` shows the traceback instead. The long commands run
`processes.py` (which builds through `rlproxy/compose.py`); queries are in `rlproxy/storage/`;
output formats in `output.py`. Nothing imports this package: it is the entrance.

(Over 400 lines: typer reads each command's options from its function's signature, so a command's
options, checks and output stay in one function, sharing the option types above; the read commands
are in `read.py`, `rlproxy rollout` in `rollout.py`.)
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from rlproxy.cli.options import (
    ENV_NOTE,
    CleanErrors,
    describe,
    field_default,
    get_current_context,
    setting,
    settings_flags,
)
from rlproxy.inference.models import make_tiny, resolve_model
from rlproxy.logsetup import quiet_third_party
from rlproxy.settings import Settings
from rlproxy.storage import db as dbm
from rlproxy.storage import queries
from rlproxy.storage.db import normalize_url, sqlite_path

# Imported where they are used, not here: `processes` (FastAPI, uvicorn and the composition root,
# ~1 s), the embedded engine (torch), the demo and the guard's web stack. `rlproxy --help` and the
# read commands (runs, steps, sql) then start without them.

logger = logging.getLogger(__name__)

LogLevel = Literal["debug", "info", "warning", "error"]
Backend = Literal["embedded", "vllm"]


app = typer.Typer(
    cls=CleanErrors,
    help="rlproxy: an OpenAI-compatible proxy that turns agent traffic into GRPO training.",
    epilog=ENV_NOTE,
    no_args_is_help=True,
    add_completion=False,
)
db_app = typer.Typer(help="Database maintenance.", no_args_is_help=True)
models_app = typer.Typer(help="Built-in models.", no_args_is_help=True)
runs_app = typer.Typer(help="Runs: a table of recent ones, or one in full (`runs show ID`).")
app.add_typer(db_app, name="db")
app.add_typer(models_app, name="models")
app.add_typer(runs_app, name="runs", invoke_without_command=True)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"rlproxy {version('rlproxy')}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks instead of one error line")] = False,
) -> None:
    """rlproxy: an OpenAI-compatible proxy that turns agent traffic into GRPO training."""


# None when not given: the settings' default then, in data_dir (`RLPROXY_DATA_DIR`)
DbOpt = Annotated[
    str | None,
    setting("db_url", "--db", help="SQLite file or PostgreSQL URL", metavar="URL", show_default="rlproxy.db"),
]
LimitOpt = Annotated[int, typer.Option(min=1, max=1000, help="rows to show (1-1000)")]
InitOpt = Annotated[str | None, setting("init_adapter", "--init-adapter", metavar="DIR")]
# `train` and `sft` load adapters into a server on the base model the server serves
BaseModelOpt = Annotated[str, setting("model", help="the base model (same weights as the server's)")]
CheckpointDirOpt = Annotated[str | None, setting("checkpoint_dir", metavar="DIR", show_default="checkpoints")]


def upstream_opt(help: str) -> Any:
    """The `--upstream URL` option (repeatable: replicas), with what this command does with it."""
    return Annotated[list[str] | None, setting("upstream", metavar="URL", help=help)]


def make_settings(**options: Any) -> Settings:
    """Settings from RLPROXY_* variables, overridden by the options that were given (not None)."""
    given = {k: v for k, v in options.items() if v is not None}
    from pydantic import ValidationError

    try:
        settings = Settings(**given)
        return settings.model_copy(update={"db_url": normalize_url(settings.db_url)})
    except ValidationError as exc:  # a bad RLPROXY_* variable, or a value no option type caught
        problems = [
            f"{e['loc'][0]} (RLPROXY_{str(e['loc'][0]).upper()}): {e['msg']}, got {e.get('input')!r}"
            if e.get("loc")
            else e["msg"]
            for e in exc.errors()
        ]
        raise typer.BadParameter("; ".join(problems)) from None


def _run(coro) -> None:
    """Run `coro` on uvloop (it roughly halves the proxy's per-request cost)."""
    import uvloop

    uvloop.run(coro)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per adapter/health call is noise
    quiet_third_party(level)  # Alembic INFO, progress bars, FutureWarnings: at WARNING or off


@app.command(epilog=ENV_NOTE)
@settings_flags()
def serve(
    backend: Annotated[Backend, setting("backend")] = field_default("backend"),
    model: Annotated[str, setting("model", help="smollm2-135m, tiny, or a model folder")] = field_default(
        "model"
    ),
    upstream: Annotated[
        list[str] | None, setting("upstream", metavar="URL", help="attach to this server (repeat: replicas)")
    ] = None,
    data_dir: Annotated[
        str | None,
        setting("data_dir", metavar="DIR", help="where the store and checkpoints go", show_default="."),
    ] = None,
    db: DbOpt = None,
    host: Annotated[str, setting("host")] = field_default("host"),
    port: Annotated[int, setting("port", min=0, max=65535)] = field_default("port"),
    train: Annotated[bool, setting("train", "--train/--no-train")] = field_default("train"),
    group_size: Annotated[int, setting("group_size", min=1)] = field_default("group_size"),
    groups_per_step: Annotated[int, setting("groups_per_step", min=1)] = field_default("groups_per_step"),
    api_key: Annotated[
        str | None, setting("api_key", metavar="KEY", help="agents' key (see Security)")
    ] = None,
    admin_key: Annotated[
        str | None, setting("admin_key", metavar="KEY", help="operators' key (see Security)")
    ] = None,
    model_map: Annotated[str, setting("model_map", metavar="NAME=POLICY,...", hidden=True)] = field_default(
        "model_map"
    ),
    blocking_train: Annotated[
        bool, setting("blocking_train", "--blocking-train/--no-blocking-train", hidden=True)
    ] = field_default("blocking_train"),
    init_adapter: Annotated[
        str | None, setting("init_adapter", "--init-adapter", metavar="DIR", hidden=True)
    ] = None,
    access_log: Annotated[
        bool, typer.Option("--access-log/--no-access-log", help="one log line per request", hidden=True)
    ] = True,
    log_level: Annotated[LogLevel, typer.Option(help="log level")] = "info",
    settings_given: dict[str, Any] | None = None,
) -> None:
    """Run the proxy (and the embedded engine and trainer, by default).

    The options a first start needs: --help-all shows every setting's, by group.
    """
    settings = make_settings(
        **(settings_given or {}),
        backend=backend,
        model=model,
        upstream=upstream,
        data_dir=data_dir,
        db_url=db,
        host=host,
        port=port,
        train=train,
        group_size=group_size,
        groups_per_step=groups_per_step,
        api_key=api_key,
        admin_key=admin_key,
        model_map=model_map,
        blocking_train=blocking_train,
        init_adapter=init_adapter,
    )
    _logging(log_level)
    _serve(settings, access_log, log_level)


def _port_free(host: str, port: int) -> None:
    """One error line now if `host:port` is taken, not a traceback once the model has loaded."""
    import errno
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise typer.BadParameter(
                    f"{host}:{port} is in use (another rlproxy serve or dashboard?): pick another --port",
                    param_hint="--port",
                ) from None
            raise


def _existing_db(url: str) -> None:
    """`sft` and `fork` write into a store that must exist: a typo must not start an empty one."""
    path = sqlite_path(normalize_url(url)) if normalize_url(url).startswith("sqlite") else None
    if path is not None and not Path(path).exists():
        raise typer.BadParameter(
            f"no database at {path} (`rlproxy serve --db {path}` creates one; check the path)",
            param_hint="--db",
        )


def _startup_checks(settings: Settings) -> None:
    """The start-up mistakes found before anything loads, each one `error:` line and exit 2."""
    from rlproxy.errors import RLProxyError
    from rlproxy.inference.models import check_model

    try:
        if not settings.upstream:  # a model we load (embedded) or launch vLLM on
            check_model(settings.model, settings.cache_dir)
    except RLProxyError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    try:
        asyncio.run(dbm.check_store(settings.db_url))
    except RLProxyError as exc:
        raise typer.BadParameter(str(exc), param_hint="--db") from None


def _serve(settings: Settings, access_log: bool, log_level: str, readonly: bool = False) -> None:
    from rlproxy.cli import processes  # lazy: the web stack and the composition root

    _port_free(settings.host, settings.port)
    if not readonly:
        Path(settings.data_dir).expanduser().mkdir(parents=True, exist_ok=True)
        _startup_checks(settings)

    def ready(base: str) -> None:
        if readonly:
            typer.echo(f"rlproxy dashboard (read-only) on {base}/")
        else:
            typer.echo(f"rlproxy ready. Point your app at it:\n  export OPENAI_BASE_URL={base}/v1")

    started = [False]

    async def go() -> None:
        started[0] = await processes.serve(
            settings, readonly=readonly, access_log=access_log, log_level=log_level, on_ready=ready
        )

    try:
        _run(go())
    except processes.StartupFailed as exc:  # the lifespan raised: one line, as a usage mistake
        if get_current_context().find_root().params.get("debug"):
            raise exc.cause from None
        typer.echo(f"error: rlproxy did not start: {describe(exc.cause)}", err=True)
        raise typer.Exit(2) from None
    if not started[0]:  # the lifespan failed (its error is in the log): say so in the exit code
        raise typer.Exit(1)


@app.command(epilog=ENV_NOTE)
def engine(
    model: Annotated[str, setting("model")] = field_default("model"),
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="listen port")] = 8001,
    threads: Annotated[int | None, setting("engine_threads", "--threads", min=1)] = None,
    api_key: Annotated[
        str | None,
        setting(
            "api_key", metavar="KEY", help="require Authorization: Bearer KEY on every route but /health"
        ),
    ] = None,
) -> None:
    """Serve the embedded engine alone (an OpenAI-compatible server with vLLM's adapter routes)."""
    from rlproxy.inference.embedded import DEFAULT_MAX_TOKENS, run_engine  # lazy: torch
    from rlproxy.proxy import server as http_server  # lazy: uvicorn

    settings = make_settings(model=model, engine_threads=threads, api_key=api_key, host=host, port=port)
    _logging("info")
    run_engine(
        settings.model,
        # served like `serve`: uvicorn on httptools with the connection limits of the settings
        lambda engine_app: http_server.config(engine_app, settings, access_log=False),
        threads=settings.engine_threads,
        cache_dir=Path(settings.cache_dir).expanduser(),
        api_key=settings.api_key,
        max_batch=settings.engine_max_batch,
        prefix_cache_bytes=settings.engine_prefix_cache_bytes,
        default_max_tokens=settings.engine_default_max_tokens or DEFAULT_MAX_TOKENS,
    )


@app.command(epilog=ENV_NOTE)
@settings_flags(skip=("host", "port", "api_key", "admin_key", "train", "blocking_train", "backend"))
def train(
    db: DbOpt = None,
    upstream: upstream_opt(
        "the inference server to publish adapters to (repeat for several replicas: each gets them)"
    ) = None,
    model: BaseModelOpt = field_default("model"),
    group_size: Annotated[int, setting("group_size", min=1)] = field_default("group_size"),
    groups_per_step: Annotated[int, setting("groups_per_step", min=1)] = field_default("groups_per_step"),
    nproc: Annotated[int, setting("nproc", min=0)] = field_default("nproc"),
    init_adapter: InitOpt = None,
    settings_given: dict[str, Any] | None = None,
) -> None:
    """Run the trainer as its own process (or `--nproc N` ranks) until SIGTERM / Ctrl-C."""
    settings = make_settings(
        **(settings_given or {}),
        db_url=db,
        upstream=upstream,
        model=model,
        group_size=group_size,
        groups_per_step=groups_per_step,
        nproc=nproc,
        init_adapter=init_adapter,
    )
    if not settings.upstream:
        raise typer.BadParameter("--upstream (or RLPROXY_UPSTREAM) is required: the server to publish to")
    _logging("info")
    from rlproxy.cli.processes import launch_trainer, run_trainer  # lazy: as processes

    if settings.nproc:
        launch_trainer(settings)  # torchrun's agent in this process; the ranks run processes.train_worker
    else:
        asyncio.run(run_trainer(settings))


def _checkpoint_base(checkpoint_dir: str, policy: str) -> str | None:
    """The base model the policy's newest checkpoint was trained on (peft records it), if any."""
    import json
    import re

    folder = Path(checkpoint_dir) / re.sub(
        r"[^A-Za-z0-9._-]", "_", policy
    )  # as trainer/checkpoint.py names it
    for step in sorted(folder.glob("step-*/adapter_config.json"), reverse=True):
        try:
            base = json.loads(step.read_text()).get("base_model_name_or_path")
        except (OSError, ValueError):
            continue
        if isinstance(base, str) and base and Path(base).is_dir():
            return base
    return None


def _folder_name(policy: str, hint: str) -> None:
    """A policy written to disk gets a folder of its own under the checkpoint folder (checkpoint.py's
    `policy_dir` keeps `.` and `-`): `.`, `..` or nothing would write beside or above it."""
    if policy in ("", ".", ".."):
        raise typer.BadParameter(
            f"{policy!r} is no policy name: its checkpoints need a folder of their own", param_hint=hint
        )


@app.command(epilog=ENV_NOTE)
def sft(
    ctx: typer.Context,
    policy: Annotated[str, typer.Option(help="the policy to train (its newest step is continued)")],
    where: Annotated[
        str | None,
        typer.Option(
            metavar="SQL",
            help="SQL condition over the trajectories view and the runs' columns (as export --where), "
            "e.g. \"reward >= 0.9 AND policy = 'p'\"; validation runs are left out unless --include-val",
        ),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file", metavar="JSONL", help='OpenAI chat JSONL: {"messages": [...], "tools": [...]}'
        ),
    ] = None,
    from_policy: Annotated[
        str | None,
        typer.Option(
            metavar="TEACHER",
            help="distill: learn this policy's stored conversations (a hosted model's too), "
            "rendered with the student's chat template, assistant turns only",
        ),
    ] = None,
    min_reward: Annotated[
        float | None, typer.Option(help="only runs rewarded at least this (with --where/--from-policy)")
    ] = None,
    into: Annotated[
        str | None,
        typer.Option(
            metavar="NEW_POLICY",
            help="train a fork: NEW_POLICY gets the SFT step as its step 1, starting from POLICY's newest "
            "step (or the base); POLICY keeps serving as it was, promote NEW_POLICY when it is good "
            "(default with --from-policy: POLICY-distilled)",
        ),
    ] = None,
    publish: Annotated[
        bool,
        typer.Option("--publish", help="add the step to POLICY itself: every serve serves it within seconds"),
    ] = False,
    include_val: Annotated[
        bool, typer.Option("--include-val", help="let --where select validation runs (split = 'val') too")
    ] = False,
    epochs: Annotated[int, typer.Option(min=1, help="passes over the examples")] = 1,
    batch_size: Annotated[int, typer.Option(min=1, help="examples per optimizer step")] = 16,
    learning_rate: Annotated[float | None, setting("learning_rate", min=0)] = None,
    db: DbOpt = None,
    upstream: upstream_opt("also load the new adapter into this server (else serve's poll does)") = None,
    model: BaseModelOpt = field_default("model"),
    checkpoint_dir: CheckpointDirOpt = None,
) -> None:
    """Supervised fine-tuning from stored runs (exact tokens) or a chat file, published as the next step."""
    from rlproxy.cli import processes  # lazy: the web stack and the composition root

    if from_policy is None and (where is None) == (file is None):
        raise typer.BadParameter("give one of --where (SQL over trajectories) and --file (chat JSONL)")
    if from_policy is not None and file is not None:
        raise typer.BadParameter("--from-policy reads the store: it takes --where, not --file")
    if from_policy is not None and into is None:
        into = f"{policy}-distilled"  # a new policy: the student's live traffic is not switched
    if file is not None and not file.is_file():
        raise typer.BadParameter(f"{file} is not a file", param_hint="--file")
    if into is None and not publish:
        raise typer.BadParameter(
            f"an SFT step on {policy!r} goes live on every serve within seconds: train a fork with "
            f"--into NEW_POLICY (then promote it), or say --publish",
            param_hint="--into/--publish",
        )
    if into is not None and publish:
        raise typer.BadParameter("give --into NEW_POLICY or --publish, not both", param_hint="--into")
    _folder_name(into or policy, "--into" if into is not None else "--policy")
    settings = make_settings(
        db_url=db, upstream=upstream, model=model, checkpoint_dir=checkpoint_dir, learning_rate=learning_rate
    )
    _existing_db(settings.db_url)
    if ctx.get_parameter_source("model").name == "DEFAULT":  # the base is the checkpoint's, not a guess
        base = _checkpoint_base(settings.checkpoint_dir, policy)
        if base is not None:
            settings = settings.model_copy(update={"model": base})
    _logging("warning")

    def progress(done: int, total: int, metrics: dict[str, float]) -> None:
        typer.echo(f"sft: optimizer step {done}/{total}, loss {metrics['loss/total']:.4f}", err=True)

    target = into or policy
    typer.echo(f"SFT of {target}: reading the examples, then {epochs} epoch(s) ...")
    out = asyncio.run(
        processes.run_sft(
            settings,
            policy,
            where=where,
            file=file,
            epochs=epochs,
            batch_size=batch_size,
            from_policy=from_policy,
            min_reward=min_reward,
            into=into,
            include_val=include_val,
            on_step=progress,
        )
    )
    typer.echo(
        f"step {out['step']} of {target} (sft): loss {out['loss/total']:.4f}, token accuracy "
        f"{out['sft/token_accuracy']:.3f}, {int(out['sft/examples'])} examples -> {out['adapter_path']}"
    )
    if into is not None:
        typer.echo(
            f"{policy} is unchanged. Try the fork with model: {into!r}; promote it with "
            f"RLPROXY_MODEL_MAP='*={into}' (or point the app's model at it)"
        )


@app.command(epilog=ENV_NOTE)
def fork(
    source: Annotated[str, typer.Argument(metavar="POLICY@N", help="the step to start from")],
    new_policy: Annotated[str, typer.Argument(metavar="NEW_POLICY", help="the new policy's name")],
    db: DbOpt = None,
    checkpoint_dir: CheckpointDirOpt = None,
) -> None:
    """Start a new policy from a step: NEW_POLICY@1 is POLICY@N (adapter and optimizer state)."""
    from rlproxy.cli import processes  # lazy: the web stack and the composition root

    _folder_name(new_policy, "NEW_POLICY")
    settings = make_settings(db_url=db, checkpoint_dir=checkpoint_dir)
    _existing_db(settings.db_url)
    saved = asyncio.run(processes.fork(settings, source, new_policy))
    typer.echo(f"{new_policy}@1 = {source} ({saved.path}); a running serve serves it within seconds")


def _read(db: str, fn: Any, *, check: bool = True, timeout: float | None = None) -> Any:
    """`await fn(engine)` on a read-only engine on the store `db` (checked to be rlproxy's)."""
    url = make_settings(db_url=db).db_url

    async def go() -> Any:
        engine_ = await queries.open_readonly(url, statement_timeout_s=timeout, check=check)
        try:
            return await fn(engine_)
        finally:
            await engine_.dispose()

    return asyncio.run(go())


# The read commands (runs, runs show, steps, sql, export) live in `read.py`; registered here, so that
# `rlproxy --help` lists the commands in the order they always had.
from rlproxy.cli import read as _read_commands  # noqa: E402, F401, I001


@app.command(epilog=ENV_NOTE)
def dashboard(
    db: DbOpt = None,
    host: Annotated[str, setting("host")] = field_default("host"),
    port: Annotated[int, setting("dashboard_port", "--port", min=0, max=65535)] = field_default(
        "dashboard_port"
    ),
    admin_key: Annotated[str | None, setting("admin_key", metavar="KEY")] = None,
    log_level: Annotated[LogLevel, typer.Option(help="log level")] = "warning",
) -> None:
    """The dashboard alone, read-only on a database: no model, no trainer, no OpenAI routes."""
    from rlproxy.proxy.guard import is_loopback  # lazy: starlette

    settings = make_settings(db_url=db, host=host, port=port, admin_key=admin_key, train=False)
    if not is_loopback(settings.host) and not settings.admin_key:
        raise typer.BadParameter(
            f"serving every run's data on {settings.host} without a key: give --admin-key "
            "(or RLPROXY_ADMIN_KEY), or keep --host on loopback (127.0.0.1)",
            param_hint="--host",
        )
    _read(settings.db_url, lambda e: asyncio.sleep(0))  # a bad --db is one error line, before serving
    _logging(log_level)
    _serve(settings, access_log=False, log_level=log_level, readonly=True)


@app.command()
def demo(
    minutes: Annotated[float, typer.Option(min=0.1, help="stop after this many minutes")] = 10.0,
    model: Annotated[str, typer.Option(help="built-in name or model folder")] = "smollm2-135m",
    out_dir: Annotated[Path, typer.Option(help="where the database, plot and summary.json go")] = Path(
        "demo-output"
    ),
    fast: Annotated[bool, typer.Option(help="tiny random model, a few steps (what CI runs)")] = False,
    task: Annotated[
        Literal["number", "directory"],
        typer.Option(help="number: a two-turn game; directory: a tool-using agent (lookups, then an answer)"),
    ] = "number",
    backend: Annotated[
        Backend, typer.Option(help="inference server (vllm: set RLPROXY_VLLM_PYTHON)")
    ] = "embedded",
    group_size: Annotated[
        int | None, typer.Option(min=2, help="episodes per group, one step each; default 8 (--fast: 4)")
    ] = None,
    learning_rate: Annotated[
        float | None, typer.Option(min=0, help="AdamW learning rate; default: serve's (by model size)")
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of the trainer and of the agent's sampling")] = 0,
    rollout: Annotated[
        Literal["immediate", "canary"],
        typer.Option(help="canary: each new step earns its traffic; stops at the first promotion"),
    ] = "immediate",
    teacher: Annotated[
        bool,
        typer.Option(
            help="directory task from a hosted teacher: capture its episodes, distill the student, "
            "then RL (three rungs: base, after SFT, after RL)"
        ),
    ] = False,
    teacher_episodes: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="--teacher: the teacher's episodes the student is distilled from (default 32)",
        ),
    ] = None,
    max_groups: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="stop after this many groups, one trainer step each (a step budget; --teacher: RL groups "
            "after the SFT step, default 20)",
        ),
    ] = None,
    signal: Annotated[
        Literal["groups", "singletons", "scorer"] | None,
        typer.Option(
            help="where the signal comes from, measured on fixed validation prompts (rungs): groups (the "
            "app's groups and rewards), singletons (a new task every episode, app rewards, "
            "singletons=train), "
            "scorer (a new task every episode, no app reward: siblings scored by the task's checker over "
            "HTTP); default: today's demo"
        ),
    ] = None,
    siblings: Annotated[
        str | None,
        typer.Option(help="serve's siblings (off, new, alone, plateau, a comma list); --signal scorer: new"),
    ] = None,
    scorer: Annotated[
        Literal["url", "checks", "judge"] | None,
        typer.Option(help="what scores siblings and the shadow check; url (default): the task's checker"),
    ] = None,
    shadow: Annotated[
        int | None, typer.Option(min=0, help="serve's shadow_prompts: the shadow check's prompts (0 = off)")
    ] = None,
    rung_minutes: Annotated[
        float | None,
        typer.Option(
            min=0.01, help="minutes between rungs with --signal/--siblings/--shadow (default 2; directory 4)"
        ),
    ] = None,
) -> None:
    """The full loop on the embedded defaults: serve + trainer + an agent that learns a task."""
    import signal as signals  # `signal` is the --signal option here

    from rlproxy.demo.run import TASKS, run_demo  # lazy: the demo and its clients

    _logging("warning")
    signals.signal(signals.SIGTERM, signals.default_int_handler)  # stopped as by Ctrl-C: serve stopped too
    if teacher_episodes is not None and not teacher:
        raise typer.BadParameter("--teacher-episodes is the distill demo's: add --teacher")
    signal_options = (signal, siblings, scorer, shadow, rung_minutes)
    if teacher and any(v is not None for v in signal_options):
        raise typer.BadParameter(
            "--signal, --siblings, --scorer, --shadow, --rung-minutes: not with --teacher"
        )
    if teacher:
        if task != "directory":
            raise typer.BadParameter("--teacher runs the directory task: add --task directory")
        from rlproxy.demo.distill import run_distill_demo  # lazy: as the demo

        run_distill_demo(
            minutes=minutes, model=model, out_dir=out_dir, fast=fast, seed=seed, group_size=group_size,
            learning_rate=learning_rate, rl_groups=max_groups, teacher_episodes=teacher_episodes,
            echo=typer.echo,
        )  # fmt: skip
        return
    summary = run_demo(
        minutes=minutes,
        model=model,
        out_dir=out_dir,
        fast=fast,
        task=task,
        backend=backend,
        group_size=group_size,
        learning_rate=learning_rate,
        seed=seed,
        goal=TASKS[task].GOAL,
        echo=typer.echo,
        rollout=rollout,
        max_groups=max_groups,
        signal_mode=signal,
        siblings=siblings,
        scorer=scorer,
        shadow=shadow,
        rung_minutes=rung_minutes,
    )
    if "signal" in summary:  # the rungs are the measure
        goal, gain = summary["signal"]["rung_goal"], summary.get("rung_gain")
        if not fast and (gain or 0.0) < goal:
            typer.echo(
                f"The goal (+{goal} on the rungs) was not reached in time; see summary.json.", err=True
            )
    elif not fast and (summary.get("improvement") or 0.0) < TASKS[task].GOAL:
        from rlproxy.demo.pace import shortfall  # lazy: as the demo

        typer.echo(
            shortfall(summary, TASKS[task].GOAL), err=True
        )  # why (CPU share, skipped groups), what next


@db_app.command("upgrade", epilog=ENV_NOTE)
def db_upgrade(db: DbOpt = None) -> None:
    """Apply the Alembic migrations up to head (creates the database if there is none)."""
    url = make_settings(db_url=db).db_url
    dbm.upgrade(url)
    typer.echo(f"database at head: {url}")


@models_app.command("prepare", epilog=ENV_NOTE)
def models_prepare(
    name: Annotated[Literal["smollm2-135m", "tiny"], typer.Argument(help="the built-in model")],
    cache_dir: Annotated[str, setting("cache_dir")] = field_default("cache_dir"),
) -> None:
    """Prepare a built-in model into the cache (offline)."""
    typer.echo(resolve_model(name, cache_dir=cache_dir))


@models_app.command("make-tiny")
def models_make_tiny(
    out_dir: Annotated[Path, typer.Argument(help="folder to write the tiny model to")],
) -> None:
    """Write the small random `tiny` model (for tests) to OUT_DIR."""
    typer.echo(str(make_tiny(out_dir)))


from rlproxy.cli import keys as _keys  # noqa: E402, F401  (registers `rlproxy keys`; issue 55)
from rlproxy.cli import rollout as _rollout  # noqa: E402, F401  (registers `rlproxy rollout`; issue 28)
from rlproxy.cli import settings_cmd as _settings_cmd  # noqa: E402, F401  (registers `rlproxy settings`)
