"""`rlproxy import FILE...`: other tools' traces into the store (rlproxy/traces/imports.py).

Registered on the app by the import in `main.py` (after `export`, its opposite). Each malformed
record is one line on stderr (the first 20; the summary counts them all); the last line on stdout
sums up. Exit 0 when anything could be read, 2 when nothing could (bad usage, no record at all).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated

import typer

from rlproxy.cli.options import ENV_NOTE, DbOpt, app, make_settings, setup_logging
from rlproxy.traces.imports import Format, import_files

SHOWN = 20  # malformed records printed one by one; the rest only counted


@app.command("import", epilog=ENV_NOTE)
def import_(
    files: Annotated[list[Path], typer.Argument(metavar="FILE...", help="trace files (.gz too)")],
    fmt: Annotated[
        Format,
        typer.Option(
            "--format",
            help="auto: by each record's fields (protobuf by suffix .pb/.binpb or binary content)",
        ),
    ] = "auto",
    score: Annotated[str | None, typer.Option(metavar="NAME", help="the score that is the reward")] = None,
    policy: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="store the calls under this policy (else their model's name)"),
    ] = None,
    db: DbOpt = None,
) -> None:
    """Import traces (OTLP GenAI spans, Langfuse, LangSmith, OpenAI chat JSONL) as text-only runs."""
    from rlproxy.storage.db import create_engine, upgrade_async

    for f in files:
        if not f.is_file():
            raise typer.BadParameter(f"{f} is not a file", param_hint="FILE")
    settings = make_settings(db_url=db)
    setup_logging("warning")
    shown = 0

    def malformed(line: str) -> None:
        nonlocal shown
        shown += 1
        if shown <= SHOWN:
            typer.echo(f"malformed: {line}", err=True)

    async def go():
        await upgrade_async(settings.db_url)
        engine = create_engine(settings.db_url)
        try:
            if not sys.stderr.isatty():
                return await import_files(
                    engine, files, fmt, score=score, policy=policy, on_malformed=malformed
                )
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("importing", total=sum(f.stat().st_size for f in files))
                return await import_files(
                    engine,
                    files,
                    fmt,
                    score=score,
                    policy=policy,
                    on_malformed=malformed,
                    on_progress=lambda n: bar.advance(task, n),
                )
        finally:
            await engine.dispose()

    summary = asyncio.run(go())
    if shown > SHOWN:
        typer.echo(f"malformed: ... and {shown - SHOWN} more", err=True)
    if summary.imported + summary.duplicates + summary.scores == 0:
        typer.echo(
            f"error: nothing could be read from {', '.join(map(str, files))} ({summary.line()})", err=True
        )
        raise typer.Exit(2)
    typer.echo(summary.line())
