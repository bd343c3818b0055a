"""The `rlproxy` command line: it parses options into `Settings` and calls the composition root.

Every option also reads `RLPROXY_<OPTION>`: the Settings object is built from the environment
first, then the options actually given on the command line override it. What `serve` runs is built
by `rlproxy/compose.py` (`build_app`), the one place that wires the parts together.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from rlproxy.errors import RLProxyError
from rlproxy.settings import Settings

logger = logging.getLogger(__name__)

ENV_NOTE = "Every option also reads RLPROXY_<OPTION> (e.g. RLPROXY_DB_URL, RLPROXY_API_KEY); options win."

app = typer.Typer(
    help="rlproxy: an OpenAI-compatible proxy that turns agent traffic into GRPO training.",
    epilog=ENV_NOTE,
    no_args_is_help=True,
    add_completion=False,
)
db_app = typer.Typer(help="Database maintenance.", no_args_is_help=True)
models_app = typer.Typer(help="Built-in models.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(models_app, name="models")

DbOpt = Annotated[str | None, typer.Option("--db", help="database URL or SQLite path [env RLPROXY_DB_URL]")]


def make_settings(**options: Any) -> Settings:
    """Settings from RLPROXY_* variables, overridden by the options that were given (not None)."""
    given = {k: v for k, v in options.items() if v is not None}
    if "db_url" in given:
        from rlproxy.storage.db import normalize_url

        given["db_url"] = normalize_url(given["db_url"])
    try:
        return Settings(**given)
    except ValueError as exc:  # pydantic's ValidationError
        raise typer.BadParameter(str(exc)) from None


def _run(coro) -> None:
    """Run `coro` on uvloop (it roughly halves the proxy's per-request cost)."""
    import uvloop

    uvloop.run(coro)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per adapter/health call is noise


@app.command(epilog=ENV_NOTE)
def serve(
    backend: Annotated[str | None, typer.Option(help="embedded | vllm [env RLPROXY_BACKEND]")] = None,
    model: Annotated[str | None, typer.Option(help="smollm2-135m, tiny, or a HF model folder")] = None,
    upstream: Annotated[str | None, typer.Option(help="attach to this OpenAI-compatible server URL")] = None,
    db: DbOpt = None,
    host: Annotated[str | None, typer.Option(help="listen address")] = None,
    port: Annotated[int | None, typer.Option(help="listen port")] = None,
    train: Annotated[
        bool | None, typer.Option("--train/--no-train", help="run the trainer inside serve")
    ] = None,
    group_size: Annotated[int | None, typer.Option(help="completed runs that make a group")] = None,
    groups_per_step: Annotated[int | None, typer.Option(help="groups per optimizer step")] = None,
    api_key: Annotated[
        str | None, typer.Option(help="agents' key: OpenAI routes and rewards need Authorization: Bearer KEY")
    ] = None,
    admin_key: Annotated[
        str | None, typer.Option(help="operators' key: all runs, stats, training steps, /metrics, dashboard")
    ] = None,
    model_map: Annotated[
        str | None, typer.Option(help="name=policy,*=policy for hard-coded model names")
    ] = None,
    blocking_train: Annotated[
        bool | None,
        typer.Option("--blocking-train/--no-blocking-train", help="hold new requests while a step trains"),
    ] = None,
    access_log: Annotated[
        bool, typer.Option("--access-log/--no-access-log", help="one log line per request")
    ] = True,
    log_level: Annotated[str, typer.Option(help="debug, info, warning")] = "info",
) -> None:
    """Run the proxy (and the embedded engine and trainer, by default)."""
    settings = make_settings(
        backend=backend,
        model=model,
        upstream=upstream,
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
    )
    _logging(log_level)
    try:
        _run(_serve(settings, access_log, log_level))
    except RLProxyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


async def _serve(settings: Settings, access_log: bool, log_level: str) -> None:
    import uvicorn

    from rlproxy.compose import build_app
    from rlproxy.proxy import server as http_server

    _raise_open_files(settings.max_connections + 256)  # each connection is a file descriptor
    application = build_app(settings)
    config = http_server.config(application, settings, access_log=access_log, log_level=log_level)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        sock = server.servers[0].sockets[0].getsockname()
        host = settings.host if settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        typer.echo(
            f"rlproxy ready. Point your app at it:\n  export OPENAI_BASE_URL=http://{host}:{sock[1]}/v1"
        )
    await task


def _raise_open_files(wanted: int) -> None:
    """Raise the soft open-files limit toward `wanted` (at most the hard one): the cap binds, not EMFILE."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


@app.command()
def engine(
    model: Annotated[str | None, typer.Option(help="smollm2-135m, tiny, or a HF model folder")] = None,
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="listen port")] = 8001,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    api_key: Annotated[
        str | None, typer.Option(help="require Authorization: Bearer KEY on every route but /health")
    ] = None,
) -> None:
    """Serve the embedded engine alone (an OpenAI-compatible server with vLLM's adapter routes)."""
    from rlproxy.inference.embedded import run_engine
    from rlproxy.proxy import server as http_server

    settings = make_settings(model=model, engine_threads=threads, api_key=api_key, host=host, port=port)
    _logging("info")
    run_engine(
        settings.model,
        # served like `serve`: uvicorn on httptools with the connection limits of the settings
        lambda engine_app: http_server.config(engine_app, settings, access_log=False),
        threads=settings.engine_threads,
        cache_dir=Path(settings.cache_dir).expanduser(),
        api_key=settings.api_key,
    )


@app.command(epilog=ENV_NOTE)
def train(
    db: DbOpt = None,
    upstream: Annotated[str | None, typer.Option(help="the inference server to publish adapters to")] = None,
    model: Annotated[str | None, typer.Option(help="the base model (same weights as the server's)")] = None,
    group_size: Annotated[int | None, typer.Option(help="completed runs that make a group")] = None,
    groups_per_step: Annotated[int | None, typer.Option(help="groups per optimizer step")] = None,
) -> None:
    """Run the trainer as its own process until SIGTERM / Ctrl-C."""
    settings = make_settings(
        db_url=db, upstream=upstream, model=model, group_size=group_size, groups_per_step=groups_per_step
    )
    if not settings.upstream:
        raise typer.BadParameter("--upstream (or RLPROXY_UPSTREAM) is required: the server to publish to")
    _logging("info")
    try:
        asyncio.run(_train(settings))
    except RLProxyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


async def _train(settings: Settings) -> None:
    from rlproxy.compose import trainer_config
    from rlproxy.inference.vllm import VLLMBackend
    from rlproxy.storage import db
    from rlproxy.trainer.service import TrainerService

    url = db.normalize_url(settings.db_url)
    await db.upgrade_async(url)
    backend = VLLMBackend(
        settings.model,
        cache_dir=Path(settings.cache_dir).expanduser(),
        upstream=settings.upstream,
        api_key=settings.upstream_api_key,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await backend.start()
    service = TrainerService(trainer_config(settings), url, backend)
    try:
        await service.start()
        logger.info("trainer running against %s; SIGTERM to stop", settings.upstream)
        await stop.wait()
    finally:
        await service.stop()
        await backend.stop()


@app.command()
def runs(
    db: DbOpt = None,
    status: Annotated[
        str | None, typer.Option(help="open, completed, trained, skipped, failed, expired")
    ] = None,
    limit: Annotated[int, typer.Option(help="rows to show")] = 20,
) -> None:
    """A table of recent runs."""
    settings = make_settings(db_url=db)

    async def fetch() -> list[dict]:
        from rlproxy.storage import db as dbm
        from rlproxy.storage import queries

        engine_ = dbm.create_engine(dbm.normalize_url(settings.db_url), readonly=True)
        try:
            rows, _ = await queries.list_runs(engine_, status=status, limit=limit)
            return rows
        finally:
            await engine_.dispose()

    rows = asyncio.run(fetch())
    cols = ["id", "group_id", "policy", "status", "reward", "n_completions", "created_at"]
    _table([{c: r.get(c) for c in cols if c in r or c in cols} for r in rows], cols)


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="the SQL to run (read-only)")],
    db: DbOpt = None,
    json_lines: Annotated[bool, typer.Option("--json", help="print JSON lines instead of a table")] = False,
    timeout: Annotated[
        float | None, typer.Option(help="seconds a statement may run [env RLPROXY_SQL_TIMEOUT, default 30]")
    ] = None,
) -> None:
    """Run read-only SQL against the store (writes fail: the database is opened read-only)."""
    settings = make_settings(db_url=db, sql_timeout=timeout)

    async def execute() -> tuple[list[str], list[tuple]]:
        from sqlalchemy import text

        from rlproxy.storage import db as dbm

        engine_ = dbm.create_engine(
            dbm.normalize_url(settings.db_url), readonly=True, statement_timeout_s=settings.sql_timeout
        )
        try:
            async with engine_.connect() as conn:
                result = await conn.execute(text(query))
                if not result.returns_rows:
                    return [], []
                return list(result.keys()), [tuple(r) for r in result.fetchall()]
        finally:
            await engine_.dispose()

    try:
        cols, rows = asyncio.run(execute())
    except Exception as exc:  # sqlalchemy errors: a write on a read-only database, bad SQL, ...
        message = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        squashed = message.replace("-", "").replace(" ", "").lower()
        if "readonly" in squashed or "attacheddatabases" in squashed:
            message += " (rlproxy sql opens the database read-only: writes and ATTACH are refused)"
        elif "interrupted" in squashed or "statementtimeout" in squashed:
            message += f" (the statement ran past the {settings.sql_timeout:g} s limit: --timeout)"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(1) from None
    if json_lines:
        import orjson

        for row in rows:
            sys.stdout.buffer.write(orjson.dumps(dict(zip(cols, row, strict=True)), default=str) + b"\n")
        sys.stdout.flush()
    else:
        _table([dict(zip(cols, row, strict=True)) for row in rows], cols)


def _table(rows: list[dict], cols: list[str]) -> None:
    """Print rows as a plain aligned table (long cells cut at 60 chars)."""

    def cell(v: Any) -> str:
        s = "" if v is None else str(v)
        return s if len(s) <= 60 else s[:57] + "..."

    cells = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
    typer.echo("  ".join("-" * w for w in widths))
    for row in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    typer.echo(f"({len(rows)} rows)")


@app.command()
def demo(
    minutes: Annotated[float, typer.Option(help="stop after this many minutes")] = 10.0,
    model: Annotated[str, typer.Option(help="built-in name or model folder")] = "smollm2-135m",
    out_dir: Annotated[Path, typer.Option(help="where the database, plot and summary.json go")] = Path(
        "demo-output"
    ),
    fast: Annotated[bool, typer.Option(help="tiny random model, a few steps (what CI runs)")] = False,
) -> None:
    """The full loop on the embedded defaults: serve + trainer + an agent that learns a task."""
    from rlproxy.demo.run import run_demo

    _logging("warning")
    summary = run_demo(minutes=minutes, model=model, out_dir=out_dir, fast=fast, echo=typer.echo)
    if not fast and summary.get("last3_mean_reward", 0) - summary.get("first3_mean_reward", 0) < 0.5:
        typer.echo("The goal (+0.5 mean reward) was not reached in time; see summary.json.", err=True)


@db_app.command("upgrade")
def db_upgrade(db: DbOpt = None) -> None:
    """Apply the Alembic migrations up to head."""
    from rlproxy.storage import db as dbm

    settings = make_settings(db_url=db)
    url = dbm.normalize_url(settings.db_url)
    dbm.upgrade(url)
    typer.echo(f"database at head: {url}")


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="smollm2-135m or tiny")],
    cache_dir: Annotated[str | None, typer.Option(help="cache folder [env RLPROXY_CACHE_DIR]")] = None,
) -> None:
    """Prepare a built-in model into the cache (offline)."""
    from rlproxy.inference.models import resolve_model

    try:
        path = resolve_model(name, cache_dir=cache_dir)
    except RLProxyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(path)


@models_app.command("make-tiny")
def models_make_tiny(
    out_dir: Annotated[Path, typer.Argument(help="folder to write the tiny model to")],
) -> None:
    """Write the small random `tiny` model (for tests) to OUT_DIR."""
    from rlproxy.inference.models import make_tiny

    typer.echo(str(make_tiny(out_dir)))
