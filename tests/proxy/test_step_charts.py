"""The dashboard's step charts are made from storage's one list of step columns (issue 23): the page
draws what `GET /v1/training/metrics` says, and that is the list the page hard-coded before."""

from __future__ import annotations

from rlproxy.proxy.dashboard import STEP_COLUMNS, step_charts
from rlproxy.storage.step_columns import STEP_COLUMNS as METRIC_COLUMNS
from rlproxy.storage.step_columns import StepChart, StepColumn

# app.js's CHARTS before it read them from the data route (kinds: a function there, `sft` here)
OLD_CHARTS = [
    {
        "id": "zero_variance_frac",
        "title": "zero-variance groups",
        "unit": "fraction, skipped ones too",
        "cols": ["zero_variance_frac"],
        "yMin": 0,
        "yMax": 1,
    },
    {"id": "kl", "title": "KL", "unit": "per token", "cols": ["kl"]},
    {
        "id": "clip",
        "title": "clipped tokens",
        "unit": "fraction",
        "cols": ["clip_frac_low", "clip_frac_high"],
        "names": ["low", "high"],
        "yMin": 0,
    },
    {"id": "entropy", "title": "entropy", "unit": "nats per token", "cols": ["entropy"], "yMin": 0},
    {
        "id": "completion_len_mean",
        "title": "completion length",
        "unit": "tokens",
        "cols": ["completion_len_mean"],
        "yMin": 0,
    },
    {
        "id": "policy_lag_mean",
        "title": "policy lag",
        "unit": "adapter steps",
        "cols": ["policy_lag_mean"],
        "yMin": 0,
    },
    {
        "id": "tokens_per_s",
        "title": "training throughput",
        "unit": "tokens/s",
        "cols": ["tokens_per_s"],
        "yMin": 0,
    },
    {
        "id": "grad_norm",
        "title": "gradient norm",
        "unit": "before clipping",
        "cols": ["grad_norm"],
        "yMin": 0,
    },
    {"id": "loss", "title": "loss", "unit": "GRPO steps", "cols": ["loss"]},
    {
        "id": "sft_loss",
        "title": "SFT loss",
        "unit": "cross-entropy, SFT steps",
        "cols": ["loss"],
        "sft": True,
        "yMin": 0,
    },
]


def test_charts_are_the_ones_the_page_drew() -> None:
    assert step_charts() == OLD_CHARTS


def test_every_charted_column_is_served() -> None:
    for chart in step_charts():
        assert set(chart["cols"]) <= set(STEP_COLUMNS), chart


def test_a_new_column_with_a_chart_shows_up(monkeypatch) -> None:  # noqa: ANN001
    """A column added to storage's list is charted without touching the dashboard."""
    column = StepColumn("x/new", "a new metric", chart=StepChart("new", "a new metric", "units"))
    monkeypatch.setitem(METRIC_COLUMNS, "new_metric", column)
    assert step_charts()[-3] == {
        "id": "new",
        "title": "a new metric",
        "unit": "units",
        "cols": ["new_metric"],
    }
