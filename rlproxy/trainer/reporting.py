"""Each step's metrics, also sent to the experiment trackers people already use (setting `report_to`).

    tensorboard   event files in {metrics_log_dir}/{policy}/ (pip install 'rlproxy[tensorboard]')
    wandb         one W&B run per policy, project $WANDB_PROJECT or "rlproxy" (pip install 'rlproxy[wandb]')
    mlflow        one MLflow run per policy in experiment "rlproxy", at $MLFLOW_TRACKING_URI (e.g.
                  sqlite:///mlflow.db or a server) else MLflow's default (pip install 'rlproxy[mlflow]')

The store stays the record (`training_steps`); a tracker that fails is logged and left behind, never
a reason to stop training. A tracker named but not installed is a ConfigError when the trainer is
built, so `serve` stops at once with the pip command instead of training without it.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlproxy.errors import ConfigError
from rlproxy.settings import TRACKERS as TRACKERS  # the names live with the setting `report_to`
from rlproxy.settings import parse_report_to as parse_report_to

if TYPE_CHECKING:  # an annotation only: step.py loads torch, this module does not need it
    from rlproxy.trainer.step import StepResult

log = logging.getLogger(__name__)


def _safe(name: str) -> str:
    """A policy name as one folder / run name (policies may hold '/', ':' or '@')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "policy"


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics dict (trackers reject NaN, strings, None)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def progress_line(policy: str, step: int, r: StepResult, seconds: float) -> str:
    """The one log line of a step. %.3g: a loss of 2e-05 or a KL of 3e-07 is information, `0.0000` is not."""
    m = r.metrics
    kl = m.get("kl/step", m.get("kl/ref", m.get("kl/approx", 0.0)))
    return (
        f"step {step} {policy}: {r.num_groups} groups, {r.num_runs} runs, {r.num_tokens} tokens, "
        f"reward {r.mean_reward:.3g} (std {m.get('reward/std', 0.0):.3g}), loss {r.loss:.3g}, kl {kl:.3g}, "
        f"clip {m.get('clip/low_frac', 0.0):.3g}/{m.get('clip/high_frac', 0.0):.3g}, "
        f"entropy {m.get('entropy/mean', 0.0):.3g}, grad norm {m.get('loss/grad_norm', 0.0):.3g}, "
        f"lag {m.get('perf/policy_lag_mean', 0.0):.2g}, {m.get('perf/tokens_per_s', 0.0):.0f} tok/s, "
        f"{seconds:.1f} s"
    )


class MetricsReporter:
    """Writes each step's metrics to the trackers in `report_to`; one writer/run per policy, opened lazily."""

    def __init__(self, report_to: list[str], log_dir: str, config: Mapping[str, Any] | None = None) -> None:
        for name in report_to:
            module = TRACKERS[name]
            if importlib.util.find_spec(module) is None:
                raise ConfigError(
                    f"report_to names {name!r} but the {module!r} package is not installed: "
                    f"pip install 'rlproxy[{name}]' (or drop it from RLPROXY_REPORT_TO)"
                )
        self.report_to = list(report_to)
        self.log_dir = Path(log_dir).expanduser()
        self.config = dict(config or {})
        self._open: dict[tuple[str, str], Any] = {}  # (tracker, policy) -> writer / run
        self._broken: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.report_to)

    def log(self, policy: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Send one step's metrics (blocking I/O: call it off the event loop)."""
        values = scalars(metrics)
        for name in self.report_to:
            if name in self._broken:
                continue
            try:
                getattr(self, f"_log_{name}")(policy, step, values)
            except Exception:
                # a tracker is a copy of what the store holds: losing it must not stop training
                self._broken.add(name)
                log.exception(
                    "could not write step %d of %r to %s; not reporting to it again", step, policy, name
                )

    def close(self) -> None:
        """Flush and close every writer and run."""
        for (name, _policy), handle in list(self._open.items()):
            try:
                if name == "tensorboard":
                    handle.close()
                elif name == "wandb":
                    handle.finish()
                elif name == "mlflow":
                    client, run_id = handle
                    client.set_terminated(run_id)
            except Exception:
                log.warning("could not close the %s writer", name, exc_info=True)
        self._open.clear()

    # ------------------------------------------------------------------ trackers

    def _log_tensorboard(self, policy: str, step: int, values: dict[str, float]) -> None:
        writer = self._open.get(("tensorboard", policy))
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(self.log_dir / _safe(policy)))
            self._open["tensorboard", policy] = writer
        for key, value in values.items():
            writer.add_scalar(key, value, global_step=step)
        writer.flush()  # a step is minutes apart: readers should see it now

    def _log_wandb(self, policy: str, step: int, values: dict[str, float]) -> None:
        run = self._open.get(("wandb", policy))
        if run is None:
            import wandb

            self.log_dir.mkdir(parents=True, exist_ok=True)
            run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "rlproxy"),
                name=policy,
                dir=str(self.log_dir),
                config={"policy": policy, **self.config},
                reinit="create_new",  # one run per policy in one process
            )
            self._open["wandb", policy] = run
        run.log(values, step=step, commit=True)  # a step is minutes apart: send it now

    def _log_mlflow(self, policy: str, step: int, values: dict[str, float]) -> None:
        handle = self._open.get(("mlflow", policy))
        if handle is None:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient

            client = MlflowClient()  # MLFLOW_TRACKING_URI, else MLflow's default
            experiment = client.get_experiment_by_name("rlproxy")
            exp_id = experiment.experiment_id if experiment else client.create_experiment("rlproxy")
            run = client.create_run(exp_id, run_name=policy, tags={"rlproxy.policy": policy})
            handle = self._open["mlflow", policy] = (client, run.info.run_id)
            params = [Param(k, str(v)[:500]) for k, v in self.config.items()]  # the resolved trainer config
            client.log_batch(run.info.run_id, params=params)
        from mlflow.entities import Metric

        client, run_id = handle
        now = int(time.time() * 1000)
        # MLflow metric names allow letters, digits, _ - . / and spaces
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])
