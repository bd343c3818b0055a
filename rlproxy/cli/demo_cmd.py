"""`rlproxy demo`: the full loop on the embedded defaults, serve + trainer + an agent that learns a
task (`rlproxy/demo/`, imported when the command runs).

Registered on the app by the import in `main.py` (after `dashboard`, where `rlproxy --help` lists it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from rlproxy.cli.options import Backend, app, setup_logging


@app.command()
def demo(
    minutes: Annotated[float, typer.Option(min=0.1, help="stop after this many minutes")] = 10.0,
    model: Annotated[str, typer.Option(help="built-in name or model folder")] = "smollm2-135m",
    out_dir: Annotated[Path, typer.Option(help="where the database, plot and summary.json go")] = Path(
        "demo-output"
    ),
    fast: Annotated[bool, typer.Option(help="tiny random model, a few steps (what CI runs)")] = False,
    task: Annotated[
        Literal["number", "directory"],
        typer.Option(help="number: a two-turn game; directory: a tool-using agent (lookups, then an answer)"),
    ] = "number",
    backend: Annotated[
        Backend, typer.Option(help="inference server (vllm: set RLPROXY_VLLM_PYTHON)")
    ] = "embedded",
    group_size: Annotated[
        int | None, typer.Option(min=2, help="episodes per group, one step each; default 8 (--fast: 4)")
    ] = None,
    learning_rate: Annotated[
        float | None, typer.Option(min=0, help="AdamW learning rate; default: serve's (by model size)")
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of the trainer and of the agent's sampling")] = 0,
    rollout: Annotated[
        Literal["immediate", "canary"],
        typer.Option(help="canary: each new step earns its traffic; stops at the first promotion"),
    ] = "immediate",
    teacher: Annotated[
        bool,
        typer.Option(
            help="directory task from a hosted teacher: capture its episodes, distill the student, "
            "then RL (three rungs: base, after SFT, after RL)"
        ),
    ] = False,
    teacher_episodes: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="--teacher: the teacher's episodes the student is distilled from (default 32)",
        ),
    ] = None,
    max_groups: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="stop after this many groups, one trainer step each (a step budget; --teacher: RL groups "
            "after the SFT step, default 20)",
        ),
    ] = None,
    signal: Annotated[
        Literal["groups", "singletons", "scorer"] | None,
        typer.Option(
            help="where the signal comes from, measured on fixed validation prompts (rungs): groups (the "
            "app's groups and rewards), singletons (a new task every episode, app rewards, "
            "singletons=train), "
            "scorer (a new task every episode, no app reward: siblings scored by the task's checker over "
            "HTTP); default: today's demo"
        ),
    ] = None,
    siblings: Annotated[
        str | None,
        typer.Option(help="serve's siblings (off, new, alone, plateau, a comma list); --signal scorer: new"),
    ] = None,
    scorer: Annotated[
        Literal["url", "checks", "judge"] | None,
        typer.Option(help="what scores siblings and the shadow check; url (default): the task's checker"),
    ] = None,
    shadow: Annotated[
        int | None, typer.Option(min=0, help="serve's shadow_prompts: the shadow check's prompts (0 = off)")
    ] = None,
    rung_minutes: Annotated[
        float | None,
        typer.Option(
            min=0.01, help="minutes between rungs with --signal/--siblings/--shadow (default 2; directory 4)"
        ),
    ] = None,
    max_steps: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="with --signal/--siblings/--shadow: stop once the policy serves this trainer step (sibling "
            "groups count too); the last rung is measured at it",
        ),
    ] = None,
) -> None:
    """The full loop on the embedded defaults: serve + trainer + an agent that learns a task."""
    import signal as signals  # `signal` is the --signal option here

    from rlproxy.demo.run import TASKS, run_demo  # lazy: the demo and its clients

    setup_logging("warning")
    signals.signal(signals.SIGTERM, signals.default_int_handler)  # stopped as by Ctrl-C: serve stopped too
    if teacher_episodes is not None and not teacher:
        raise typer.BadParameter("--teacher-episodes is the distill demo's: add --teacher")
    signal_options = (signal, siblings, scorer, shadow, rung_minutes, max_steps)
    if teacher and any(v is not None for v in signal_options):
        raise typer.BadParameter(
            "--signal, --siblings, --scorer, --shadow, --rung-minutes, --max-steps: not with --teacher"
        )
    if teacher:
        if task != "directory":
            raise typer.BadParameter("--teacher runs the directory task: add --task directory")
        from rlproxy.demo.distill import run_distill_demo  # lazy: as the demo

        run_distill_demo(
            minutes=minutes, model=model, out_dir=out_dir, fast=fast, seed=seed, group_size=group_size,
            learning_rate=learning_rate, rl_groups=max_groups, teacher_episodes=teacher_episodes,
            echo=typer.echo,
        )  # fmt: skip
        return
    summary = run_demo(
        minutes=minutes,
        model=model,
        out_dir=out_dir,
        fast=fast,
        task=task,
        backend=backend,
        group_size=group_size,
        learning_rate=learning_rate,
        seed=seed,
        goal=TASKS[task].GOAL,
        echo=typer.echo,
        rollout=rollout,
        max_groups=max_groups,
        signal_mode=signal,
        siblings=siblings,
        scorer=scorer,
        shadow=shadow,
        rung_minutes=rung_minutes,
        max_steps=max_steps,
    )
    if "signal" in summary:  # the rungs are the measure
        goal, gain = summary["signal"]["rung_goal"], summary.get("rung_gain")
        if not fast and (gain or 0.0) < goal:
            typer.echo(
                f"The goal (+{goal} on the rungs) was not reached in time; see summary.json.", err=True
            )
    elif not fast and (summary.get("improvement") or 0.0) < TASKS[task].GOAL:
        from rlproxy.demo.pace import shortfall  # lazy: as the demo

        typer.echo(
            shortfall(summary, TASKS[task].GOAL), err=True
        )  # why (CPU share, skipped groups), what next
