"""`rlproxy keys`: an app's key per app — create, list, revoke (issue 55; docs/tenancy.md, docs/cli.md).

Registered on the app by the import at the end of `rlproxy/cli/main.py`. The keys live in the
store's `keys` table (storage/keys.py), so every `serve` replica on that store reads them: a key
created or revoked here is in force on each of them within 2 s (proxy/keys.py TTL_S). The secret is
printed once, by `create`, and never stored (only its sha256).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer

from rlproxy.cli.options import ENV_NOTE, DbOpt, field_default, make_settings
from rlproxy.cli.options import app as main_app
from rlproxy.cli.output import print_table
from rlproxy.storage import db as dbm
from rlproxy.storage import keys as store

app = typer.Typer(help="Apps' keys: create, list, revoke.", no_args_is_help=True)
main_app.add_typer(app, name="keys")

LIST_COLUMNS = (
    "id",
    "name",
    "policies",
    "rpm",
    "tpm",
    "max_streams",
    "created_at",
    "last_used_at",
    "revoked_at",
)


def _with_engine(db: str, fn: Any) -> Any:
    url = make_settings(db_url=db).db_url
    dbm.upgrade(url)  # the keys table is in migration 0016: a store made before it is brought to head

    async def go() -> Any:
        engine = dbm.create_engine(url)
        try:
            return await fn(engine)
        finally:
            await engine.dispose()

    return asyncio.run(go())


@app.command("create", epilog=ENV_NOTE)
def create(
    name: Annotated[str, typer.Option("--name", help="the app's name, unique (e.g. shop-agent)")],
    policies: Annotated[
        str | None, typer.Option(help="comma list of the policies it may use (default: all)")
    ] = None,
    rpm: Annotated[int | None, typer.Option(min=1, help="requests per minute (default: no limit)")] = None,
    tpm: Annotated[int | None, typer.Option(min=1, help="tokens per minute (default: no limit)")] = None,
    max_streams: Annotated[
        int | None, typer.Option(min=1, help="streams in flight (default: no limit)")
    ] = None,
    scorer_url: Annotated[
        str | None, typer.Option(help="the app's own scorer for its siblings (docs/siblings.md)")
    ] = None,
    db: DbOpt = field_default("db_url"),
) -> None:
    """Create a key for one app; its secret (rk-...) is printed once, never again."""
    if not name.strip() or len(name) > 128:
        raise typer.BadParameter("1-128 characters", param_hint="--name")
    allowed = None
    if policies is not None:
        allowed = [p.strip() for p in policies.split(",") if p.strip()]
        if not allowed:
            raise typer.BadParameter(
                "name at least one policy (or leave it out: all)", param_hint="--policies"
            )

    async def go(engine: Any) -> tuple[dict[str, Any], str]:
        return await store.create(
            engine, name, policies=allowed, rpm=rpm, tpm=tpm, max_streams=max_streams, scorer_url=scorer_url
        )

    try:
        row, secret = _with_engine(db, go)
    except store.KeyNameTaken as exc:
        raise typer.BadParameter(str(exc), param_hint="--name") from None
    typer.echo(f"key {row['id']} ({name}): {secret}")
    typer.echo("the secret is shown only now: give it to the app as its API key")


@app.command("list", epilog=ENV_NOTE)
def list_(db: DbOpt = field_default("db_url")) -> None:
    """Every key, valid and revoked, oldest first (never a secret)."""
    rows = _with_engine(db, store.list_keys)
    print_table(list(LIST_COLUMNS), [[_cell(r.get(c)) for c in LIST_COLUMNS] for r in rows])


def _cell(value: Any) -> Any:
    return ",".join(value) if isinstance(value, list) else value


@app.command("revoke", epilog=ENV_NOTE)
def revoke(
    name: Annotated[str, typer.Argument(metavar="NAME", help="the key's name")],
    db: DbOpt = field_default("db_url"),
) -> None:
    """Revoke a key: every replica refuses it (401) within 2 s."""

    async def go(engine: Any) -> bool:
        return await store.revoke(engine, name)

    if not _with_engine(db, go):
        raise typer.BadParameter(f"no valid key named {name!r} (rlproxy keys list)", param_hint="NAME")
    typer.echo(f"key {name} revoked: refused on every replica within 2 s")
