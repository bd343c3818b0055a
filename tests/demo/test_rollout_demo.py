"""demo/canary.py: the canary loop samples groups without waiting for training, prints each rollout
as it opens and as it is decided (read from the demo's SQLite file), and stops at the first promotion."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from rlproxy.demo.canary import CANARY_ENV, canary_loop
from rlproxy.demo.harness import Loop
from rlproxy.settings import Settings
from rlproxy.storage.db import upgrade


@dataclass
class Episode:
    reward: float
    replies: list[str]
    group_id: str = "g"


class Agent:
    """Stands in for the number game; each group moves the rollouts table along, as the trainer would."""

    def __init__(self, db: Path) -> None:
        self.db, self.calls = db, 0

    def run_group(self, *args: object, **kwargs: object) -> list[Episode]:
        self.calls += 1
        with sqlite3.connect(self.db) as con:
            if self.calls == 1:
                con.execute(
                    "INSERT INTO rollouts (policy, candidate_step, incumbent_step, fraction, status, looks, "
                    "started_at) VALUES ('p', 1, 0, 0.5, 'canary', 0, '2026-12-01 10:00:00')"
                )
            if self.calls == 3:
                con.execute(
                    "UPDATE rollouts SET status = 'promoted', reason = 'better: welch_t=3.10', "
                    "candidate_runs = 16,"
                    " incumbent_runs = 17, candidate_reward = 0.75, incumbent_reward = 0.25"
                )
        return [Episode(float(i % 2), ["a", "b"]) for i in range(4)]


def test_canary_loop_stops_at_the_first_promotion(tmp_path: Path) -> None:
    db = tmp_path / "rlproxy.db"
    upgrade(f"sqlite+aiosqlite:///{db}")
    plan = SimpleNamespace(minutes=5, max_groups=20, group_size=4, temperature=1.0, max_tokens=8, seed=0)
    lines: list[str] = []
    rows: list[dict] = []
    loop = Loop("http://127.0.0.1:9", None, "p", plan, Agent(db), rows, time.monotonic(), lines.append, db)  # type: ignore[arg-type]
    why = canary_loop(loop)
    assert why == "promoted" and len(rows) == 3
    assert "  canary: step 1 serves half of the new runs, step 0 the rest" in lines
    assert lines[-1] == (
        "  step 1 promoted over step 0: better: welch_t=3.10 "
        "(candidate 16 runs, reward 0.750; incumbent 17 runs, reward 0.250)"
    )


def test_the_demo_canary_settings_are_valid_settings() -> None:
    s = Settings(**{k.removeprefix("RLPROXY_").lower(): v for k, v in CANARY_ENV.items()})
    assert s.rollout == "canary" and s.canary_fraction == 0.5 and s.canary_inconclusive == "promote"
