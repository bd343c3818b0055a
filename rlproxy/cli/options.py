"""How the `rlproxy` command line is made: options generated from the settings, errors as one line,
and the app every command module registers on, with what several commands share.

`setting(name, ...)` makes the typer Option of a settings field: its help is the field's description
(escaped, so that rich's help formatter shows `[::1]` and `[env var: ...]` as written), it reads
`RLPROXY_<NAME>`, and `--help` shows that variable and the field's default, the same as the README's
table. `CleanErrors` is the root command: a user's mistake anywhere below it (a bad option, a
missing database, bad SQL) ends with one `error: ...` line on stderr and exit 2 (usage) or 1
(the rest); `rlproxy --debug ...` lets the traceback through.

`app` is the root command; the command modules (`main.py`, `offline.py`, `read.py`, `demo_cmd.py`,
`settings_cmd.py`, `keys.py`, `rollout.py`) add their commands to it, and `main.py` imports them
all. `make_settings` turns a command's options into `Settings`.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

import typer
from pydantic import ValidationError
from rich.markup import escape
from sqlalchemy.exc import SQLAlchemyError
from typer.core import TyperGroup, TyperOption

try:  # typer >= 0.2x carries its own copy of click
    from typer._click import exceptions as click_errors
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer uses click itself
    import click.exceptions as click_errors
    from click import get_current_context

from rlproxy.errors import RLProxyError
from rlproxy.logsetup import quiet_third_party
from rlproxy.settings import GROUPS, Settings
from rlproxy.storage import queries
from rlproxy.storage.db import normalize_url

ENV_NOTE = escape(
    "Every setting is read from its RLPROXY_* variable when its option is not given (the command "
    "line wins): `rlproxy settings` lists each with its variable and default (docs/configuration.md)."
)


def _first_line(exc: BaseException) -> str:
    message = str(getattr(exc, "orig", None) or exc).strip()
    return message.splitlines()[0] if message else type(exc).__name__


def describe(exc: BaseException) -> str:
    """One line that says what went wrong, for an error a user caused or can fix."""
    if isinstance(exc, RLProxyError | ValueError):
        return _first_line(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    if isinstance(exc, SQLAlchemyError):
        message = _first_line(exc)
        squashed = message.replace("-", "").replace(" ", "").lower()
        if "readonly" in squashed or "attacheddatabases" in squashed:
            message += " (rlproxy opens the database read-only: writes and ATTACH are refused)"
        elif "interrupted" in squashed or "statementtimeout" in squashed:
            message += " (the statement ran past the time limit: --timeout / RLPROXY_SQL_TIMEOUT)"
        return message
    return f"{type(exc).__name__}: {_first_line(exc)} (rlproxy --debug ... shows the traceback)"


# `rlproxy db` (a group with no command) prints its help by raising this one; let it.
_PASS_THROUGH = tuple(c for c in [getattr(click_errors, "NoArgsIsHelpError", None)] if c is not None)


class CleanErrors(TyperGroup):
    """The root command: every error below it becomes one line on stderr (see the module doc)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, KeyboardInterrupt, *_PASS_THROUGH):
            raise
        except click_errors.UsageError as exc:
            if ctx.params.get("debug"):
                raise
            where = exc.ctx.command_path if exc.ctx else ctx.command_path
            message = exc.format_message().replace("Value error, ", "")  # pydantic's prefix, noise here
            hint = _setting_hint(exc, where)
            typer.echo(f"error: {message}{hint} (see `{where} --help`)", err=True)
            raise typer.Exit(2) from None
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            typer.echo(f"error: {describe(exc)}", err=True)
            raise typer.Exit(1) from None


def _setting_hint(exc: Exception, where: str) -> str:
    """For `No such option: --report-to` where report_to is a setting: how to set it here."""
    option = getattr(exc, "option_name", None)
    if not option:
        return ""
    name = setting_for_option(option)
    if name is None:
        return ""
    return f"; {option} is the setting {name}: set RLPROXY_{name.upper()} for `{where}`"


def default_text(name: str) -> Any:
    """A setting's default as the README's table shows it."""
    field = Settings.model_fields[name]
    default = field.default if field.default_factory is None else field.default_factory()
    return ", ".join(default) if isinstance(default, list) else default


def setting(name: str, *decls: str, help: str | None = None, **kwargs: Any) -> Any:
    """A typer Option for setting `name`: its description, `RLPROXY_<NAME>`, its default shown."""
    field = Settings.model_fields[name]
    kwargs.setdefault("show_default", default_text(name) not in (None, ""))
    return typer.Option(
        *decls,
        help=escape(help or field.description or ""),
        envvar=f"RLPROXY_{name.upper()}",
        show_envvar=True,
        **kwargs,
    )


def field_default(name: str) -> Any:
    """The default of setting `name` (what an option that sets it defaults to)."""
    return Settings.model_fields[name].default


# --- every other setting a flag (`serve --learning-rate`, `--report-to`, ...) ----------------------


def _option_type(annotation: Any) -> Any:
    """The type an option of a setting takes: its own, without None; None for the ones a flag cannot
    carry (dicts, lists: the environment variable, as JSON, is their way in)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if annotation in (bool, int, float, str) or typing.get_origin(annotation) is Literal:
        return annotation
    return None


def settings_flags(*, skip: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command an option for every setting it does not have one for already.

    Each is made by `setting()` (the field's help, `RLPROXY_<NAME>`, its default shown) and defaults
    shows the setting's default; only the options given (on the command line or by their variable)
    reach the command, as a dict in its `settings_given` parameter (which is not an option), for
    `make_settings`, with the values of the command's own options that set a setting (`db`: db_url).
    `skip`: settings left out.
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(fn, include_extras=True)  # resolved in the command's module
        sig = inspect.signature(fn)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in sig.parameters.values()
            if p.name != "settings_given"
        ]
        taken = set(skip) | {p.name for p in own}
        sets: dict[str, str] = {}  # own option -> the setting it sets (`db` sets db_url: taken too)
        for i, p in enumerate(own):
            metas = list(getattr(p.annotation, "__metadata__", ()))
            for j, meta in enumerate(metas):
                envvar = getattr(meta, "envvar", None)
                if isinstance(envvar, str) and envvar.startswith("RLPROXY_"):
                    sets[p.name] = envvar.removeprefix("RLPROXY_").lower()
                    taken.add(sets[p.name])
                    metas[j] = copy.copy(meta)  # shared by other commands (DbOpt): a copy
                    metas[j].show_envvar = False  # short --help: the epilog says it once; --help-all shows it
            if metas:
                own[i] = p.replace(annotation=Annotated[(p.annotation.__origin__, *metas)])
        extra = []
        for name, field in Settings.model_fields.items():
            kind = _option_type(field.annotation)
            if name in taken or kind is None:
                continue
            decls = (f"--{name.replace('_', '-')}/--no-{name.replace('_', '-')}",) if kind is bool else ()
            option = setting(
                name,
                *decls,
                rich_help_panel=f"Settings: {_group_of(name)}",
                hidden=True,  # `--help-all` shows them (and `rlproxy settings`): --help stays short
            )
            default = field.default if field.default_factory is None else field.default_factory()
            extra.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=default,
                    annotation=Annotated[kind | None, option],
                )
            )
        names = [p.name for p in extra]
        extra.append(
            inspect.Parameter(
                "help_all",
                inspect.Parameter.KEYWORD_ONLY,
                default=False,
                annotation=Annotated[
                    bool,
                    typer.Option(
                        "--help-all",
                        is_eager=True,
                        callback=_help_all,
                        help="every setting's option, by group",
                    ),
                ],
            )
        )

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            ctx = get_current_context(silent=True)
            kwargs.pop("help_all", None)
            given = {n: kwargs.pop(n) for n in names if n in kwargs}
            # only what the command line (or its variable) gave: a default is Settings' own business
            given = {
                k: v for k, v in given.items() if ctx is None or ctx.get_parameter_source(k).name != "DEFAULT"
            }
            given.update({sets[n]: kwargs[n] for n in sets if n in kwargs})  # own options: always
            return fn(*args, settings_given=given, **kwargs)

        keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        params = [*keyword, *extra]
        command.__signature__ = sig.replace(parameters=params, return_annotation=None)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}  # objects, not strings
        del command.__wrapped__  # typer reads __signature__, not the wrapped function's
        return command

    return wrap


def _help_all(ctx: typer.Context, value: bool) -> None:
    """`--help-all`: the help with every option shown, the hidden ones (settings by group) too."""
    if not value or ctx.resilient_parsing:
        return
    for param in ctx.command.params:
        param.hidden = False
        param.show_envvar = bool(getattr(param, "envvar", None))
    typer.echo(ctx.get_help())
    raise typer.Exit()


def _group_of(name: str) -> str:
    """The title of the settings group that holds field `name` ("Trainer", "Store", ...)."""
    return next((title for title, cls in GROUPS if name in cls.model_fields), "other")


def setting_for_option(option: str) -> str | None:
    """The setting an unknown `--option` names (`--learning-rate` -> learning_rate), or None."""
    name = option.lstrip("-").removeprefix("no-").replace("-", "_")
    return name if name in Settings.model_fields else None


# Typer shows a flag's type as `<bool>` in --help: noise next to `--train/--no-train`.
_display_type = getattr(TyperOption, "display_type_rich", None)
if _display_type is not None:

    def _no_bool_type(self: TyperOption, ctx: Any) -> Any:
        return None if self.is_flag else _display_type(self, ctx)

    TyperOption.display_type_rich = _no_bool_type  # type: ignore[method-assign]


# --- the app every command registers on, and what several commands share ------------------------

Backend = Literal["embedded", "vllm"]
LogLevel = Literal["debug", "info", "warning", "error"]

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
# `train` and `sft` load adapters into a server on the base model the server serves
BaseModelOpt = Annotated[str, setting("model", help="the base model (same weights as the server's)")]


def upstream_opt(help: str) -> Any:
    """The `--upstream URL` option (repeatable: replicas), with what this command does with it."""
    return Annotated[list[str] | None, setting("upstream", metavar="URL", help=help)]


def make_settings(**options: Any) -> Settings:
    """Settings from RLPROXY_* variables, overridden by the options that were given (not None)."""
    given = {k: v for k, v in options.items() if v is not None}
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


def setup_logging(level: str) -> None:
    """The log lines of a command, at `level`."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per adapter/health call is noise
    quiet_third_party(level)  # Alembic INFO, progress bars, FutureWarnings: at WARNING or off


def read_store(db: str, fn: Any, *, check: bool = True, timeout: float | None = None) -> Any:
    """`await fn(engine)` on a read-only engine on the store `db` (checked to be rlproxy's)."""
    url = make_settings(db_url=db).db_url

    async def go() -> Any:
        engine_ = await queries.open_readonly(url, statement_timeout_s=timeout, check=check)
        try:
            return await fn(engine_)
        finally:
            await engine_.dispose()

    return asyncio.run(go())
