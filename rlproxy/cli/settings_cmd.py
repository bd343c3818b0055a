"""`rlproxy settings`: every setting by group, with its variable, its option and its default.

What `serve --help-all` shows as option tables, as plain text a person can read at 80 columns
(and grep): the same fields as docs/configuration.md's tables, from `rlproxy.settings.GROUPS`.
"""

from __future__ import annotations

import shutil
import textwrap
from typing import Annotated

import typer

from rlproxy.cli.options import app, default_text
from rlproxy.settings import GROUPS


@app.command("settings")
def settings_list(
    group: Annotated[
        str | None, typer.Argument(help=f"one group: {', '.join(name for name, _ in GROUPS)}")
    ] = None,
) -> None:
    """Every setting by group: its RLPROXY_* variable, its `serve` option, its default, what it does."""
    names = [name for name, _ in GROUPS]
    if group is not None and group not in names:
        raise typer.BadParameter(f"no group {group!r}: one of {', '.join(names)}", param_hint="GROUP")
    width = min(shutil.get_terminal_size((80, 24)).columns, 100)
    for title, cls in GROUPS:
        if group is not None and title != group:
            continue
        what = (cls.__doc__ or "").split(": ", 1)[-1].strip().splitlines()[0]
        typer.echo("\n".join(textwrap.wrap(f"[{title}] {what}", width)))
        for name, field in cls.model_fields.items():
            default = default_text(name)
            shown = "" if default in (None, "") else f" = {default}"
            option = "--db" if name == "db_url" else f"--{name.replace('_', '-')}"
            head = f"RLPROXY_{name.upper()}  {option}{shown}"
            typer.echo(
                "\n".join(textwrap.wrap(head, width - 2, initial_indent="  ", subsequent_indent="    "))
            )
            for line in textwrap.wrap(field.description or "", width - 6):
                typer.echo(f"      {line}")
        typer.echo("")
