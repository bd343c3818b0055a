"""The `rlproxy` command line: it parses options into `Settings` and calls the composition root.

Options that set a setting are made from the settings object (`options.setting`): their help,
environment variable and default are the field's, the same as the README's table. A user's mistake
(a bad option, a missing database, bad SQL) ends with one `error: ...` line and a non-zero exit
(`options.CleanErrors`); `rlproxy --debug ...` shows the traceback instead. The long commands run
`processes.py` (which builds through `rlproxy/compose.py`); queries are in `rlproxy/storage/`;
output formats in `output.py`. Nothing imports this package: it is the entrance.

Each command module adds its commands to `options.app`; this one holds `serve`, `engine`, `train`,
`dashboard`, `db` and `models`, and imports the others where `rlproxy --help` lists them: `sft` and
`fork` (`offline.py`), `runs`, `steps`, `sql`, `export` (`read.py`), `import` (`traces_cmd.py`),
`demo` (`demo_cmd.py`), `settings` (`settings_cmd.py`), `keys` (`keys.py`) and `rollout` (`rollout.py`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from rlproxy.cli.options import (
    ENV_NOTE,
    Backend,
    BaseModelOpt,
    DbOpt,
    LogLevel,
    app,
    db_app,
    describe,
    field_default,
    get_current_context,
    make_settings,
    models_app,
    read_store,
    setting,
    settings_flags,
    setup_logging,
    upstream_opt,
)
from rlproxy.errors import RLProxyError
from rlproxy.inference.models import check_model, make_tiny, resolve_model
from rlproxy.settings import Settings
from rlproxy.storage import db as dbm

# Imported where they are used, not here: `processes` (FastAPI, uvicorn and the composition root,
# ~1 s), the embedded engine (torch), the demo and the guard's web stack. `rlproxy --help` and the
# read commands (runs, steps, sql) then start without them.


def _run(coro) -> None:
    """Run `coro` on uvloop (it roughly halves the proxy's per-request cost)."""
    import uvloop

    uvloop.run(coro)


@app.command(epilog=ENV_NOTE)
@settings_flags()
def serve(
    backend: Annotated[Backend, setting("backend")] = field_default("backend"),
    model: Annotated[str, setting("model", help="smollm2-135m, tiny, or a model folder")] = field_default(
        "model"
    ),
    upstream: upstream_opt("attach to this server (repeat: replicas)") = None,
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
    settings = make_settings(**(settings_given or {}))  # the options above that set a setting
    setup_logging(log_level)
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


def _startup_checks(settings: Settings) -> None:
    """The start-up mistakes found before anything loads, each one `error:` line and exit 2."""
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
    setup_logging("info")
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
    init_adapter: Annotated[str | None, setting("init_adapter", "--init-adapter", metavar="DIR")] = None,
    settings_given: dict[str, Any] | None = None,
) -> None:
    """Run the trainer as its own process (or `--nproc N` ranks) until SIGTERM / Ctrl-C."""
    settings = make_settings(**(settings_given or {}))  # the options above (settings_flags)
    if not settings.upstream:
        raise typer.BadParameter("--upstream (or RLPROXY_UPSTREAM) is required: the server to publish to")
    setup_logging("info")
    from rlproxy.cli.processes import launch_trainer, run_trainer  # lazy: as processes

    if settings.nproc:
        launch_trainer(settings)  # torchrun's agent in this process; the ranks run processes.train_worker
    else:
        asyncio.run(run_trainer(settings))


from rlproxy.cli import offline, read  # noqa: E402, F401, I001  (sft, fork; runs, steps, sql, export)
from rlproxy.cli import traces_cmd  # noqa: E402, F401, I001  (import)


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
    read_store(settings.db_url, lambda e: asyncio.sleep(0))  # a bad --db is one error line, before serving
    setup_logging(log_level)
    _serve(settings, access_log=False, log_level=log_level, readonly=True)


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


# registered last, in --help's order: demo, settings, then the groups keys and rollout
from rlproxy.cli import demo_cmd, keys, rollout, settings_cmd  # noqa: E402, F401, I001
