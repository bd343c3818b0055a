"""The read commands: `rlproxy runs` (and `runs show ID`), `steps`, `sql` and `export`, each on a
read-only engine on the store (`queries.open_readonly`), nothing written.

Registered on the app by the import in `rlproxy/cli/main.py` (where they always stood in
`rlproxy --help`), like `rollout.py`. Output formats are `output.py`'s.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from rlproxy.cli import output as cli_output
from rlproxy.cli.options import ENV_NOTE, DbOpt, app, field_default, read_store, runs_app, setting
from rlproxy.cli.output import print_table, run_lines, safe
from rlproxy.storage import export as exporter
from rlproxy.storage import queries
from rlproxy.storage import untagged as untagged_store
from rlproxy.storage.models import RunStatus

LimitOpt = Annotated[int, typer.Option(min=1, max=1000, help="rows to show (1-1000)")]


@runs_app.callback(epilog=ENV_NOTE)
def runs(
    ctx: typer.Context,
    db: DbOpt = None,
    status: Annotated[RunStatus | None, typer.Option(help="only runs with this status")] = None,
    limit: LimitOpt = 20,
    untagged: Annotated[
        bool,
        typer.Option(
            "--untagged",
            help="requests that carried no run id instead (reward one by its reply_id: "
            "POST /v1/completions/{reply_id}/reward)",
        ),
    ] = False,
) -> None:
    """A table of recent runs, newest first (`rlproxy runs show ID`: one run in full)."""
    if ctx.invoked_subcommand is not None:
        return
    if untagged:
        if status is not None:
            raise typer.BadParameter(
                "--status is a run's: untagged requests have none", param_hint="--untagged"
            )
        found, _ = read_store(db, lambda e: untagged_store.list_untagged(e, limit=limit))
        cols = [
            "reply_id",
            "created_at",
            "policy",
            "policy_step",
            "status_code",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
        ]
        print_table(cols, [[r.get(c) for c in cols] for r in found])
        return

    async def both(e: Any) -> Any:
        listed = await queries.list_runs(e, status=status.value if status else None, limit=limit)
        return listed[0], (await untagged_store.count_untagged(e)) if status is None else 0

    found, n_untagged = read_store(db, both)
    cols = ["id", "group_id", "policy", "status", "reward", "n_completions", "trained_step", "created_at"]
    for r in found:  # why a run was skipped or failed (zero_variance, ...), as SQL's status_reason says
        if r.get("status_reason"):
            r["status"] = f"{r['status']} ({r['status_reason']})"
    print_table(cols, [[r.get(c) for c in cols] for r in found])
    if n_untagged:
        typer.echo(
            f"and {n_untagged} request{'' if n_untagged == 1 else 's'} without a run id "
            "(no X-Run-Id): `rlproxy runs --untagged` lists them"
        )


@runs_app.command("show", epilog=ENV_NOTE)
def runs_show(
    run_id: Annotated[str, typer.Argument(metavar="ID", help="the run's X-Run-Id")],
    db: DbOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="the run as one JSON object")] = False,
) -> None:
    """One run in full: its conversation, tool calls, token counts per completion, reward, status."""
    run = read_store(db, lambda e: queries.get_run(e, run_id))
    if run is None:
        typer.echo(f"error: no run {run_id!r} in this database (`rlproxy runs` lists them)", err=True)
        raise typer.Exit(1)
    if json_out:
        import orjson

        sys.stdout.buffer.write(orjson.dumps(run, default=str, option=orjson.OPT_NON_STR_KEYS) + b"\n")
        return
    for line in run_lines(run):
        typer.echo(safe(line))


@app.command(epilog=ENV_NOTE)
def steps(
    db: DbOpt = None,
    policy: Annotated[str | None, typer.Option(help="only this policy's steps")] = None,
    limit: LimitOpt = 20,
    json_out: Annotated[bool, typer.Option("--json", help="JSON lines, every column")] = False,
) -> None:
    """The newest training steps: reward mean ± std, validation reward (best: the checkpoint kept for it),
    loss, KL, clip fractions, grad norm, lag, tokens/s."""
    rows = read_store(db, lambda e: queries.step_table(e, policy=policy, limit=limit))
    if json_out:
        cols = list(rows[0]) if rows else []
        cli_output.print_json_lines(cols, [[r.get(c) for c in cols] for r in rows])
    else:
        cli_output.print_steps(rows)


def _query_text(query: str | None, file: Path | None) -> str:
    if file is not None:
        if query is not None:
            raise typer.BadParameter("give the query or --file, not both")
        return file.read_text()
    if query is None or query == "-":
        if query is None and sys.stdin.isatty():
            raise typer.BadParameter("give a query, `-` (or a pipe) for stdin, or --file")
        return sys.stdin.read()
    return query


@app.command(epilog=ENV_NOTE)
def sql(
    query: Annotated[
        str | None, typer.Argument(help="the SQL to run (read-only); `-` or none: read it from stdin")
    ] = None,
    db: DbOpt = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="read the SQL from this file")] = None,
    json_lines: Annotated[
        bool, typer.Option("--json", help="JSON lines; JSON columns nested, numbers exact")
    ] = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="CSV with a header line")] = False,
    vertical: Annotated[
        bool, typer.Option("--vertical", "-x", help="one `column | value` block per row, nothing cut")
    ] = False,
    wide: Annotated[bool, typer.Option("--wide", "-w", help="a table whose cells are never cut")] = False,
    timeout: Annotated[float, setting("sql_timeout", "--timeout", min=0.001)] = field_default("sql_timeout"),
) -> None:
    """Run read-only SQL against the store (writes fail: the database is opened read-only).

    Tables cut cells at 60 characters (--wide, -x: never); numbers print as sqlite3 prints them.
    """
    if sum((json_lines, csv_out, vertical, wide)) > 1:
        raise typer.BadParameter("pick one of --json, --csv, --vertical, --wide")
    text = _query_text(query, file)
    if not text.strip():
        raise typer.BadParameter("the query is empty")
    cols, rows = read_store(db, lambda e: queries.run_sql(e, text), check=False, timeout=timeout)
    if json_lines:
        cli_output.print_json_lines(cols, rows)
    elif csv_out:
        cli_output.print_csv(cols, rows)
    elif vertical:
        cli_output.print_vertical(cols, rows)
    else:
        cli_output.print_table(cols, rows, cut=None if wide else cli_output.CUT)


@app.command(epilog=ENV_NOTE)
def export(
    fmt: Annotated[
        Literal["jsonl", "parquet", "hf", "otlp", "otlp-proto"],
        typer.Option(
            "--format",
            help="jsonl (no extra needed), parquet, hf (a datasets folder), or OpenTelemetry GenAI spans, "
            "a trace per run: otlp (OTLP/JSON lines) or otlp-proto (length-delimited protobuf)",
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", metavar="PATH", help="file (jsonl, parquet) or folder (hf) to write")
    ],
    where: Annotated[
        str | None,
        typer.Option(
            metavar="SQL", help='SQL condition over the trajectories view, e.g. "reward IS NOT NULL"'
        ),
    ] = None,
    db: DbOpt = None,
    force: Annotated[bool, typer.Option("--force", help="replace OUT if it exists")] = False,
    content: Annotated[
        bool, typer.Option("--content", help="otlp formats: include the messages and tool definitions")
    ] = False,
) -> None:
    """Write runs as training data: OpenAI chat messages, reward, token ids and logprobs per call
    (or, as otlp, a trace per run for Phoenix, Langfuse or an OTel collector)."""
    import shutil

    if content and not fmt.startswith("otlp"):
        raise typer.BadParameter("--content is for --format otlp or otlp-proto", param_hint="--content")
    if out.exists() and not force:
        raise typer.BadParameter(f"{out} exists (--force replaces it)", param_hint="--out")
    if out.exists() and out.is_dir() and fmt == "hf":
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt.startswith("otlp"):
        from rlproxy.traces import otlp_file  # lazy: the traces extra

        n = read_store(db, lambda e: otlp_file.write(e, out, where, content, binary=fmt == "otlp-proto"))
    else:
        n = read_store(db, lambda e: exporter.write(e, fmt, out, where))
    typer.echo(f"wrote {n} run{'' if n == 1 else 's'} to {out} ({fmt})")
