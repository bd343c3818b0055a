"""How the `rlproxy` command line is made: options generated from the settings, and errors as one line.

`setting(name, ...)` makes the typer Option of a settings field: its help is the field's description
(escaped, so that rich's help formatter shows `[::1]` and `[env var: ...]` as written), it reads
`RLPROXY_<NAME>`, and `--help` shows that variable and the field's default, the same as the README's
table. `CleanErrors` is the root command: a user's mistake anywhere below it (a bad option, a
missing database, bad SQL) ends with one `error: ...` line on stderr and exit 2 (usage) or 1
(the rest); `rlproxy --debug ...` lets the traceback through.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer >= 0.2x carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer uses click itself
    import click.exceptions as click_errors

from rlproxy.errors import RLProxyError
from rlproxy.settings import Settings

ENV_NOTE = escape(
    "Options marked [env var: NAME] read NAME when not given; every other setting in the README's "
    "table is read from its RLPROXY_* variable too. Options given on the command line win."
)


def _first_line(exc: BaseException) -> str:
    message = str(getattr(exc, "orig", None) or exc).strip()
    return message.splitlines()[0] if message else type(exc).__name__


def describe(exc: BaseException) -> str:
    """One line that says what went wrong, for an error a user caused or can fix."""
    from sqlalchemy.exc import SQLAlchemyError

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
            typer.echo(f"error: {message} (see `{where} --help`)", err=True)
            raise typer.Exit(2) from None
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            typer.echo(f"error: {describe(exc)}", err=True)
            raise typer.Exit(1) from None


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
