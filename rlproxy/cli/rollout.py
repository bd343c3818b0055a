"""`rlproxy rollout`: canary rollouts by hand — status, promote, rollback (issue 28; docs/rollout.md).

Registered on the app by the import at the end of `rlproxy/cli/main.py`. `status` reads the
`rollouts` table (and, for open rollouts, the live arms of the `rollout_runs` view) read-only;
`promote` and `rollback` close an open rollout the way the rule would (the same conditional UPDATE:
the rule and a person can never both decide one candidate). The trainer then does the rest (a
rolled-back step's checkpoint deleted, training resumed from the winner) and every proxy routes by
it within `policy_poll_interval`.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer

from rlproxy.cli.options import ENV_NOTE, DbOpt, make_settings
from rlproxy.cli.options import app as main_app
from rlproxy.cli.output import print_table
from rlproxy.storage import db as dbm
from rlproxy.storage import queries
from rlproxy.storage import rollouts as store

app = typer.Typer(help="Canary rollouts: status, promote or roll back by hand.", no_args_is_help=True)
main_app.add_typer(app, name="rollout")

PolicyOpt = Annotated[str | None, typer.Option(help="the policy (default: the one with an open rollout)")]
ReasonOpt = Annotated[str, typer.Option(help="why, stored in rollouts.reason")]
COLUMNS = (
    "id",
    "policy",
    "candidate_step",
    "incumbent_step",
    "fraction",
    "status",
    "looks",
    "candidate_runs",
    "incumbent_runs",
    "candidate_reward",
    "incumbent_reward",
    "statistic",
    "p_value",
    "decided_by",
    "reason",
)


async def _with_engine(db: str, fn: Any, *, readonly: bool) -> Any:
    url = make_settings(db_url=db).db_url
    engine = await queries.open_readonly(url) if readonly else dbm.create_engine(url)
    try:
        return await fn(engine)
    finally:
        await engine.dispose()


@app.command("status", epilog=ENV_NOTE)
def status(
    db: DbOpt = None,
    policy: PolicyOpt = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="rows to show (1-1000)")] = 10,
) -> None:
    """The newest rollouts, newest first; an open one also with its arms' live runs and reward."""

    async def go(engine: Any) -> tuple[list[dict[str, Any]], dict[int, dict[str, tuple[int, float]]]]:
        found = await store.list_rollouts(engine, policy, limit)
        live = {}
        for r in found:
            if r["status"] == "canary":
                cand, inc = await store.arm_runs(engine, r["id"])
                live[r["id"]] = {arm: _arm(runs) for arm, runs in (("candidate", cand), ("incumbent", inc))}
        return found, live

    found, live = asyncio.run(_with_engine(db, go, readonly=True))
    print_table(list(COLUMNS), [[r.get(c) for c in COLUMNS] for r in found])
    for rid, arms in live.items():
        text = ", ".join(f"{arm} {n} rewarded runs, mean reward {m:.3f}" for arm, (n, m) in arms.items())
        typer.echo(f"rollout {rid} (open) now: {text}")


def _arm(runs: list[Any]) -> tuple[int, float]:
    rewards = [r.reward for r in runs if r.reward is not None]
    return len(rewards), (sum(rewards) / len(rewards) if rewards else float("nan"))


def _decide(db: str, policy: str | None, decision: str, reason: str) -> None:
    async def go(engine: Any) -> tuple[dict[str, Any] | None, bool, list[dict[str, Any]]]:
        opened = [r for r in await store.open_rollouts(engine) if policy is None or r["policy"] == policy]
        if len(opened) != 1:
            return None, False, opened
        row = opened[0]
        return row, await store.decide(engine, row["id"], decision, reason, by="manual"), opened

    row, won, opened = asyncio.run(_with_engine(db, go, readonly=False))
    if row is None:
        where = f" of policy {policy!r}" if policy else ""
        if not opened:
            raise typer.BadParameter(f"no open rollout{where}", param_hint="--policy")
        names = ", ".join(sorted({r["policy"] for r in opened}))
        raise typer.BadParameter(
            f"several open rollouts ({names}): name one with --policy", param_hint="--policy"
        )
    if not won:
        raise typer.BadParameter(f"rollout {row['id']} was decided meanwhile (rlproxy rollout status)")
    done = "promoted" if decision == "promote" else "rolled back"
    typer.echo(f"{row['policy']}@{row['candidate_step']} {done} (incumbent was @{row['incumbent_step']})")


@app.command("promote", epilog=ENV_NOTE)
def promote(db: DbOpt = None, policy: PolicyOpt = None, reason: ReasonOpt = "promoted by hand") -> None:
    """Promote the open canary's candidate: it serves every run from now on."""
    _decide(db, policy, "promote", reason)


@app.command("rollback", epilog=ENV_NOTE)
def rollback(db: DbOpt = None, policy: PolicyOpt = None, reason: ReasonOpt = "rolled back by hand") -> None:
    """Roll the open canary's candidate back: never served again; training resumes from the incumbent."""
    _decide(db, policy, "rollback", reason)
