"""`rlproxy sft` and `rlproxy fork`: a policy's next step from examples, or a new policy from a step
(`processes.run_sft`, `processes.fork`: trainer/offline.py). Both write into an existing store.

Registered on the app by the import in `main.py` (after `train`, where `rlproxy --help` lists them).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Annotated

import typer

from rlproxy.cli.options import (
    ENV_NOTE,
    BaseModelOpt,
    DbOpt,
    app,
    field_default,
    make_settings,
    setting,
    setup_logging,
    upstream_opt,
)
from rlproxy.storage.db import normalize_url, sqlite_path

CheckpointDirOpt = Annotated[str | None, setting("checkpoint_dir", metavar="DIR", show_default="checkpoints")]


def _existing_db(url: str) -> None:
    """`sft` and `fork` write into a store that must exist: a typo must not start an empty one."""
    path = sqlite_path(normalize_url(url)) if normalize_url(url).startswith("sqlite") else None
    if path is not None and not Path(path).exists():
        raise typer.BadParameter(
            f"no database at {path} (`rlproxy serve --db {path}` creates one; check the path)",
            param_hint="--db",
        )


def _checkpoint_base(checkpoint_dir: str, policy: str) -> str | None:
    """The base model the policy's newest checkpoint was trained on (peft records it), if any."""
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
    from_source: Annotated[
        str | None,
        typer.Option(
            metavar="SOURCE",
            help="distill the stored conversations of this completions.source: import (`rlproxy import`'s "
            "traces) or hosted; with --from-policy/--where/--min-reward as filters",
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

    distill = from_policy is not None or from_source is not None
    if not distill and (where is None) == (file is None):
        raise typer.BadParameter("give one of --where (SQL over trajectories) and --file (chat JSONL)")
    if distill and file is not None:
        raise typer.BadParameter("--from-policy/--from-source read the store: they take --where, not --file")
    if distill and into is None:
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
    setup_logging("warning")

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
            from_source=from_source,
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
