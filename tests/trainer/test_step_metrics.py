"""Per-step metrics: the math with exact numbers, then one real step whose `training_steps` columns,
progress line and TensorBoard events must all be filled, finite and the same numbers."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from support import ServerlessBackend

from rlproxy.errors import ConfigError
from rlproxy.storage.training import STEP_METRIC_COLUMNS
from rlproxy.trainer import losses
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import _chunk_stats
from rlproxy.trainer.reporting import MetricsReporter, parse_report_to, progress_line
from rlproxy.trainer.service import TrainerService
from rlproxy.trainer.step import COLUMN_METRICS, StepResult, step_columns


def _need(module: str, in_ci: bool = False) -> None:
    if importlib.util.find_spec(module) is None:
        if in_ci and os.environ.get("CI") == "true":
            pytest.fail(f"CI needs {module} (it is in the dev extra)")
        pytest.skip(f"{module} not installed (pip install 'rlproxy[{module}]')")


# ------------------------------------------------------------------ exact numbers


def test_token_entropy_exact() -> None:
    """The entropy the step logs (model._chunk_stats, from the head's chunk of logits)."""
    ln3 = math.log(3.0)
    z = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [0.0, ln3, -math.inf, -math.inf], [5.0, -math.inf, -math.inf, -math.inf]]
    )  # uniform over 4; p = (1/4, 3/4); one-hot  (n=3, V=4)
    targets = torch.zeros(3, dtype=torch.long)

    def entropy(inv_temp: torch.Tensor | None) -> list[float]:
        return _chunk_stats(z.clone(), targets, inv_temp)[2].tolist()

    h = [math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), 0.0]
    assert entropy(None) == pytest.approx(h, abs=1e-6)
    # temperature 2: p = softmax(0, ln3 / 2) = (1, sqrt 3) / (1 + sqrt 3); uniform and one-hot stay so
    p1 = 1 / (1 + math.sqrt(3))
    p2 = 1 - p1
    tempered = [math.log(4.0), -(p1 * math.log(p1) + p2 * math.log(p2)), 0.0]
    assert entropy(torch.full((3,), 0.5)) == pytest.approx(tempered, abs=1e-6)
    rnd = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)) * 3
    temps = torch.tensor([0.7, 1.0, 1.3, 1.0, 0.5])
    got = _chunk_stats(rnd.clone(), torch.zeros(5, dtype=torch.long), 1 / temps)[2]
    direct = -(torch.softmax(rnd / temps[:, None], -1) * torch.log_softmax(rnd / temps[:, None], -1)).sum(-1)
    assert torch.allclose(got, direct, atol=1e-5)


def test_clip_fractions_on_a_crafted_batch() -> None:
    """Low: ratio < 1 - eps where A < 0; high: ratio > 1 + eps_high where A > 0."""
    ratios = torch.tensor([1.3, 1.1, 0.7, 0.7, 1.3, 0.9, 0.5])  # 3 tokens with A > 0, then 4 with A < 0
    old = torch.full((7,), -2.0)
    logp = old + ratios.log()
    adv, w = torch.tensor([1.0] * 3 + [-1.0] * 4), torch.full((7,), 1 / 7)
    _, m = losses.token_policy_loss(logp, old, None, adv, w, kind="grpo", epsilon=0.2, epsilon_high=0.2)
    assert m["clip/low_frac"] == pytest.approx(2 / 7)  # row 1: 0.7 and 0.5 (0.9 is inside; 1.3 has A < 0)
    assert m["clip/high_frac"] == pytest.approx(1 / 7)  # row 0: 1.3 (0.7 has A > 0: the min is unclipped)
    assert m["clip/frac"] == pytest.approx(3 / 7)
    _, m = losses.token_policy_loss(logp, old, None, adv, w, kind="dapo", epsilon=0.2, epsilon_high=0.35)
    assert (m["clip/low_frac"], m["clip/high_frac"]) == (pytest.approx(2 / 7), 0.0)  # 1.3 < 1.35


def test_step_columns_pick_and_sanitize() -> None:
    metrics = {key: float(i) for i, key in enumerate(COLUMN_METRICS.values(), start=1)}
    cols = step_columns(metrics)
    assert set(cols) | {"kind"} == set(STEP_METRIC_COLUMNS)
    assert cols == {c: metrics[k] for c, k in COLUMN_METRICS.items()}
    cols = step_columns({**metrics, "loss/grad_norm": math.inf, "entropy/mean": math.nan})
    assert cols["grad_norm"] is None and cols["entropy"] is None  # SQL NULL, never NaN or inf
    assert step_columns({})["kl"] is None


def test_zero_variance_frac_counts_skipped_groups(tmp_path: Path) -> None:
    svc = TrainerService(TrainerConfig(checkpoint_dir=str(tmp_path)), "sqlite+aiosqlite://", None)  # type: ignore[arg-type]
    svc.selection.flat_groups = 3  # skipped since the last step
    r = StepResult(2, 8, 100, 0.5, 0.1, {"reward/frac_zero_std": 0.5})  # and one equal-reward group trained
    m = svc.selection.metrics(r)
    assert m == {"reward/groups_skipped": 3.0, "reward/zero_variance_frac": 4 / 5}
    svc.selection.flat_groups = 0
    assert svc.selection.metrics(StepResult(1, 4, 10, 0.5, 0.1, {}))["reward/zero_variance_frac"] == 0.0


def test_progress_line_keeps_the_precision() -> None:
    m = {
        "reward/std": 0.4269562819, "kl/step": -2.3e-13, "clip/low_frac": 0.0, "clip/high_frac": 0.0625,
        "entropy/mean": 6.5312, "loss/grad_norm": 3.2918, "perf/policy_lag_mean": 0.5,
        "perf/tokens_per_s": 1257.4,
    }  # fmt: skip
    r = StepResult(num_groups=1, num_runs=4, num_tokens=19, mean_reward=0.4375, loss=2.38e-07, metrics=m)
    assert progress_line("tiny", 3, r, 0.24) == (
        "step 3 tiny: 1 groups, 4 runs, 19 tokens, reward 0.438 (std 0.427), loss 2.38e-07, kl -2.3e-13, "
        "clip 0/0.0625, entropy 6.53, grad norm 3.29, lag 0.5, 1257 tok/s, 0.2 s"
    )


def test_report_to_validation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_report_to(" TensorBoard,tensorboard ") == ["tensorboard"]
    assert parse_report_to("") == []
    with pytest.raises(ValueError, match="unknown tracker"):
        TrainerConfig(report_to="tensorbored")
    # a tracker whose package is missing stops the trainer where it is built (serve: before serving)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else find_spec(n, *a)
    )
    config = TrainerConfig(report_to="mlflow", checkpoint_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"pip install 'rlproxy\[mlflow\]'"):
        TrainerService(config, "sqlite+aiosqlite://", None)  # type: ignore[arg-type]


# ------------------------------------------------------------------ one real step


def _completions(rng: random.Random) -> list[dict[str, Any]]:
    prompt = [rng.randrange(3, 1200) for _ in range(rng.randint(4, 10))]
    tokens = [rng.randrange(3, 1200) for _ in range(rng.randint(2, 8))]
    # stored logprob 0 (p = 1): every current ratio is p < 1, so A < 0 tokens clip low and none clip high
    return [{"prompt_token_ids": prompt, "token_ids": [tokens], "logprobs": [[0.0] * len(tokens)]}]


async def test_real_step_fills_every_column(
    engine: AsyncEngine,
    add_run: Any,
    db_url: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _need("tensorboard", in_ci=True)  # in the dev extra: CI must run this
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rng = random.Random(0)
    rewards = [1.0, 0.0, 0.5, 0.25]
    tokens_of: dict[str, int] = {}
    for i, r in enumerate(rewards):
        comps = _completions(rng)
        tokens_of[f"A-{i}"] = len(comps[0]["token_ids"][0])
        await add_run(engine, f"A-{i}", group_id="A", reward=r, completions=comps)
    for i in range(4):  # zero variance: skipped, and counted in zero_variance_frac
        await add_run(engine, f"Z-{i}", group_id="Z", reward=1.0, completions=_completions(rng))
    config = TrainerConfig(
        group_size=4,
        learning_rate=1e-3,
        checkpoint_dir=str(tmp_path / "ck"),
        report_to="tensorboard",
        metrics_log_dir=str(tmp_path / "tb"),
    )
    svc = TrainerService(config, db_url, ServerlessBackend(tiny_model_dir))
    caplog.set_level(logging.INFO, logger="rlproxy.trainer.service")
    try:
        assert (await svc.step_once()) is not None
    finally:
        await svc.stop()

    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT * FROM training_steps"))).mappings().one()
    for col in STEP_METRIC_COLUMNS:
        assert row[col] is not None, col
    assert row["kind"] == "grpo"
    for col in set(STEP_METRIC_COLUMNS) - {"kind"}:
        assert math.isfinite(row[col]), col
    metrics = row["metrics"] if isinstance(row["metrics"], dict) else json.loads(row["metrics"])
    assert {c: metrics[k] for c, k in COLUMN_METRICS.items()} == {c: row[c] for c in COLUMN_METRICS}

    # the numbers this test can know exactly
    assert row["reward_std"] == pytest.approx(0.4269562819)  # unbiased std of 1, 0, 0.5, 0.25
    assert row["zero_variance_frac"] == 0.5  # group Z skipped, group A trained
    assert row["policy_lag_mean"] == 0.0  # sampled by the base, trained from the base
    assert row["completion_len_mean"] == sum(tokens_of.values()) / 4
    below_mean = tokens_of["A-1"] + tokens_of["A-3"]  # rewards 0 and 0.25 < 0.4375: A < 0
    assert row["clip_frac_low"] == pytest.approx(below_mean / sum(tokens_of.values()))
    assert row["clip_frac_high"] == 0.0
    assert row["kl"] == metrics["kl/approx"] > 0  # beta = 0: the approximate KL to the sampler
    vocab = len(json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"])
    assert 0 < row["entropy"] <= math.log(vocab) + 1e-4
    assert row["grad_norm"] > 0 and row["tokens_per_s"] > 0

    # the progress line: every number with the precision it has
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1 tiny:"))
    assert f"loss {row['loss']:.3g}," in line and f"kl {row['kl']:.3g}," in line
    assert f"grad norm {row['grad_norm']:.3g}," in line and "0.0000" not in line

    # TensorBoard: the same numbers, at step 1, read back from the event file
    acc = EventAccumulator(str(tmp_path / "tb" / "tiny"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for col, key in COLUMN_METRICS.items():
        assert key in tags, key
        (event,) = acc.Scalars(key)
        assert event.step == 1 and event.value == pytest.approx(row[col], rel=1e-6, abs=1e-6), key
    (mean,) = acc.Scalars("reward/mean")
    assert mean.value == pytest.approx(0.4375)


# ------------------------------------------------------------------ optional trackers, where installed

STEP_METRICS = {
    "loss/total": 0.25,
    "kl/step": 1e-3,
    "clip/low_frac": 0.5,
    "reward/mean": 0.75,
    "bad": math.nan,
}


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _need("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    reporter = MetricsReporter(["wandb"], str(tmp_path), {"lr": 1e-3})
    reporter.log("tiny", 1, STEP_METRICS)
    reporter.log("tiny", 2, {**STEP_METRICS, "loss/total": 0.125})
    run = reporter._open["wandb", "tiny"]
    assert not reporter._broken
    deadline = time.monotonic() + 30  # the run's summary follows its history asynchronously
    while dict(run.summary).get("_step") != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    summary = dict(run.summary)
    assert (summary.get("_step"), summary.get("loss/total"), summary.get("kl/step")) == (2, 0.125, 1e-3)
    assert "bad" not in summary  # NaN is not sent
    assert list(tmp_path.glob(f"wandb/offline-run-*/run-{run.id}.wandb"))  # under metrics_log_dir
    reporter.close()


def test_mlflow_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _need("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    reporter = MetricsReporter(["mlflow"], str(tmp_path), {"lr": 1e-3})
    reporter.log("tiny", 1, STEP_METRICS)
    reporter.log("tiny", 2, {**STEP_METRICS, "loss/total": 0.125})
    client, run_id = reporter._open["mlflow", "tiny"]
    assert not reporter._broken
    history = client.get_metric_history(run_id, "loss/total")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.125)]
    assert "bad" not in client.get_run(run_id).data.metrics
    reporter.close()
