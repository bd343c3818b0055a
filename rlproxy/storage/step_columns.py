"""THE list of per-step metric columns of `training_steps`, and how each is read and shown.

Everything else derives from `STEP_COLUMNS`: the trainer's `step_columns` (a step's namespaced
metrics -> its columns), `commit_step`'s check of what it may set (`STEP_METRIC_COLUMNS`), the CLI's
fallback to older rows' metrics JSON (`storage/queries.STEP_METRICS`), the trainer's
`COLUMN_METRICS`, the ORM columns (storage/models.py) and the dashboard's step charts (`StepChart`,
served by `GET /v1/training/metrics` and drawn by `proxy/static/app.js`), so a new column is written
here once (with its migration). Migration 0005 made the FLOAT ones, 0010 (merged segments) the counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepChart:
    """Where the dashboard draws a column: one chart per `id` (columns sharing an id are its series,
    named by `series`), its title and unit, and the y axis's least range (None: the data's)."""

    id: str
    title: str
    unit: str = ""
    series: str | None = None
    y_min: float | None = None
    y_max: float | None = None


@dataclass(frozen=True)
class StepColumn:
    """A per-step metric column of `training_steps`: the step metric it copies, and the keys older rows
    kept the same number under in their `metrics` JSON (read back by storage/queries.step_table)."""

    metric: str
    comment: str  # the column's comment (storage/models.py declares the columns from this list)
    older: tuple[str, ...] = ()
    integer: bool = False  # an INTEGER column (a count), else FLOAT
    chart: StepChart | None = None  # None: no chart of its own (reward_std is the reward chart's band)


_CLIP = dict(id="clip", title="clipped tokens", unit="fraction", y_min=0)
STEP_COLUMNS: dict[str, StepColumn] = {
    "reward_std": StepColumn("reward/std", "std of the step's run rewards"),
    "zero_variance_frac": StepColumn(
        "reward/zero_variance_frac",
        "groups with equal rewards / groups seen since the last step (skipped too)",
        ("reward/frac_zero_std",),
        chart=StepChart(
            "zero_variance_frac", "zero-variance groups", "fraction, skipped ones too", y_min=0, y_max=1
        ),
    ),
    "kl": StepColumn(
        "kl/step",
        "per token: k3 to the base when beta > 0, else approx KL to the sampler",
        ("kl/ref", "kl/approx"),
        chart=StepChart("kl", "KL", "per token"),
    ),
    "clip_frac_low": StepColumn(
        "clip/low_frac",
        "fraction of tokens clipped at 1 - epsilon (A < 0)",
        chart=StepChart(**_CLIP, series="low"),
    ),
    "clip_frac_high": StepColumn(
        "clip/high_frac",
        "fraction of tokens clipped at 1 + epsilon_high (A > 0)",
        chart=StepChart(**_CLIP, series="high"),
    ),
    "entropy": StepColumn(
        "entropy/mean",
        "mean entropy of the policy at the sampled positions, nats",
        chart=StepChart("entropy", "entropy", "nats per token", y_min=0),
    ),
    "completion_len_mean": StepColumn(
        "batch/completion_len_mean",
        "mean sampled tokens per trained completion",
        chart=StepChart("completion_len_mean", "completion length", "tokens", y_min=0),
    ),
    "policy_lag_mean": StepColumn(
        "perf/policy_lag_mean",
        "mean adapter steps between sampling and training",
        chart=StepChart("policy_lag_mean", "policy lag", "adapter steps", y_min=0),
    ),
    "tokens_per_s": StepColumn(
        "perf/tokens_per_s",
        "prompt + completion tokens trained per second",
        chart=StepChart("tokens_per_s", "training throughput", "tokens/s", y_min=0),
    ),
    "grad_norm": StepColumn(
        "loss/grad_norm",
        "global gradient norm before clipping",
        chart=StepChart("grad_norm", "gradient norm", "before clipping", y_min=0),
    ),
    "positions_merged": StepColumn(
        "merge/positions_merged",
        "token positions the step's forward passes ran (calls merged into segments)",
        integer=True,
    ),
    "positions_unmerged": StepColumn(
        "merge/positions_unmerged",
        "positions one sample per trained call would have run (prompt + completion)",
        integer=True,
    ),
    "segment_breaks": StepColumn(
        "merge/breaks",
        "calls that did not extend their run's earlier tokens: a new segment each",
        integer=True,
    ),
}
# what commit_step's `columns` may set: the metric columns and `kind`
STEP_METRIC_COLUMNS: tuple[str, ...] = (*STEP_COLUMNS, "kind")


def step_columns(metrics: dict[str, Any]) -> dict[str, float | int | None]:
    """The per-step metric columns of a step's namespaced metrics; missing or non-finite values are None."""
    out: dict[str, float | int | None] = {}
    for column, spec in STEP_COLUMNS.items():
        value = metrics.get(spec.metric)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        out[column] = (int(value) if spec.integer else float(value)) if ok else None
    return out
