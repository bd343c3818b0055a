"""`rlproxy demo --rollout canary`: the demo's loop when new steps go live by canary (issue 28).

The plain loop waits for each group to be trained and served before the next one; under a canary
the trainer holds the policy until the open rollout is decided, and the decision needs runs on both
arms, so this loop keeps sampling groups and prints each rollout as it opens and as the rule decides
it (read from the `rollouts` table of the demo's database), until the first promotion.

The demo's canary settings (`CANARY_ENV`) are small so that a decision comes within minutes: half of
the new runs on the candidate, a look at 16 and at 32 rewarded runs per arm, and an inconclusive
last look promotes (`canary_inconclusive=promote`: the reason then says `inconclusive`, the
false-promote bound is traded for progress; a worse step is still rolled back). docs/rollout.md.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from rlproxy.demo.harness import Loop

CANARY_ENV = {
    "RLPROXY_ROLLOUT": "canary",
    "RLPROXY_CANARY_FRACTION": "0.5",
    "RLPROXY_CANARY_MIN_RUNS": "16",
    "RLPROXY_CANARY_LOOKS": "2",
    "RLPROXY_CANARY_INCONCLUSIVE": "promote",
}


def _rollouts(db: Path) -> list[tuple[Any, ...]]:
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return con.execute(
            "SELECT id, candidate_step, incumbent_step, status, reason, candidate_runs, incumbent_runs, "
            "candidate_reward, incumbent_reward FROM rollouts ORDER BY id"
        ).fetchall()
    except sqlite3.OperationalError:  # the server has not migrated the database yet
        return []
    finally:
        con.close()


def canary_loop(loop: Loop) -> str:
    """Sample groups until the first promotion (or time, max_groups); returns why it stopped."""
    deadline = loop.started + loop.plan.minutes * 60
    seen: dict[int, str] = {}
    while True:
        if (why := loop.stop(deadline, paced=False)) is not None:
            return why
        t0 = time.monotonic()
        episodes = loop.group()
        rewards = [e.reward for e in episodes]
        row = {
            "group": len(loop.rows) + 1,
            "step": None,
            "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
            "runs": len(episodes),
            "calls": sum(len(e.replies) for e in episodes) / max(len(episodes), 1),
            "seconds": round(time.monotonic() - t0, 2),
            "sample_seconds": round(time.monotonic() - t0, 2),
            "status": "sampled",
            "example": episodes[0].replies if episodes else [],
        }
        loop.rows.append(row)
        total_s = time.monotonic() - loop.started
        loop.echo(f"group {row['group']:3d}  reward {row['mean_reward']:.3f}  {total_s:6.0f}s total")
        for rid, cand, inc, status, reason, nc, ni, rc, ri in _rollouts(loop.db):
            if seen.get(rid) == status:
                continue
            seen[rid] = status
            if status == "canary":
                loop.echo(f"  canary: step {cand} serves half of the new runs, step {inc} the rest")
            else:
                arms = f"candidate {nc} runs, reward {rc:.3f}; incumbent {ni} runs, reward {ri:.3f}"
                loop.echo(f"  step {cand} {status.replace('_', ' ')} over step {inc}: {reason} ({arms})")
                if status == "promoted":
                    return "promoted"
