"""The demo's reward curve as a PNG, when matplotlib (the `plot` extra) is installed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'rlproxy[plot]'"
TITLES = {"number": "number game", "directory": "directory lookups (tool calls)"}


def plot_rewards(
    rows: list[dict[str, Any]],
    path: Path,
    model: str,
    echo: Callable[[str], None],
    task: str = "number",
    rungs: list[dict[str, Any]] | None = None,
) -> Path | None:
    """Write the mean reward per group to `path`, and the rungs (mean reward on the fixed validation
    prompts, at the group after which each was measured: `base` at 0); None (and a hint) without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:  # an optional extra: the summary and the SQL are the demo's record
        echo(f"no reward curve: matplotlib is not installed ({INSTALL_HINT})")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [r.get("group", r.get("step")) for r in rows]
    rewards = [r["mean_reward"] for r in rows]
    ax.plot(steps, rewards, marker="o", markersize=3, linewidth=1.5, label="mean reward of the step's group")
    if len(rows) >= 3:
        smooth = [
            sum(rewards[max(0, i - 2) : i + 1]) / len(rewards[max(0, i - 2) : i + 1])
            for i in range(len(rows))
        ]
        ax.plot(steps, smooth, linewidth=2.5, alpha=0.7, label="mean of the last 3")
    if rungs:
        at = [
            0 if r["rung"] == "base" else int(r["rung"][1:]) if r["rung"][1:].isdigit() else len(rows)
            for r in rungs
        ]
        ax.plot(at, [r["mean_reward"] for r in rungs], marker="s", linewidth=2, color="black",
                label="rung: fixed validation prompts")  # fmt: skip
    ax.set_xlabel("group (sampled by the newest policy, then one trainer step on it)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"rlproxy demo: {model} learns the {TITLES.get(task, task)}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
