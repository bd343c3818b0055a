"""What the demo reads from its own database (read-only SQLite, as `demo/canary.py` does): the runs
of an episode batch, the sibling groups branched from them, and the siblings' tally for the summary.

Sibling groups (issue 54; storage/models.py `SiblingGroup`): a group's members are runs whose
`group_id` is the sibling group's id and whose `branch_of` is the branched completion; the app's own
runs have `branch_of` NULL. A group is done when it failed, or when it is scored and every member's
run is trained, skipped, failed or expired.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

FINAL = ("trained", "skipped", "failed", "expired")
_FINAL_SQL = "('trained', 'skipped', 'failed', 'expired')"


def _read(db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows of a read-only query; [] while the server has not made the table yet."""
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return con.execute(sql, params).fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        con.close()


def _marks(n: int) -> str:
    return ",".join("?" * n)


def run_states(db: Path, run_ids: list[str]) -> dict[str, tuple[str, int | None]]:
    """run id -> (status, trained_step) of the runs stored so far."""
    rows = _read(
        db, f"SELECT id, status, trained_step FROM runs WHERE id IN ({_marks(len(run_ids))})", tuple(run_ids)
    )
    return {r[0]: (r[1], r[2]) for r in rows}


def sibling_states(db: Path, run_ids: list[str]) -> list[dict[str, Any]]:
    """The sibling groups branched from these runs' calls: id, reason, status, done, trained steps."""
    rows = _read(
        db,
        f"SELECT sg.id, sg.reason, sg.status, "
        f"(SELECT count(*) FROM runs r WHERE r.group_id = sg.id AND r.status NOT IN {_FINAL_SQL}), "
        f"(SELECT max(r.trained_step) FROM runs r WHERE r.group_id = sg.id AND r.status = 'trained') "
        f"FROM sibling_groups sg WHERE sg.run_id IN ({_marks(len(run_ids))})",
        tuple(run_ids),
    )
    return [
        {"id": i, "reason": reason, "status": status, "step": step,
         "done": status == "failed" or (status == "scored" and pending == 0)}
        for i, reason, status, pending, step in rows
    ]  # fmt: skip


def siblings_summary(db: Path) -> dict[str, Any]:
    """The siblings' tally of a demo: sibling groups made, scored, failed, trained and skipped (by
    reason), and the app's own groups trained vs skipped (zero variance), and how many of those
    skipped had a sibling group of theirs trained (rescued)."""
    made = _read(
        db,
        "SELECT sg.reason, count(*), sum(sg.status = 'scored'), sum(sg.status = 'failed'), "
        "sum(EXISTS (SELECT 1 FROM runs r WHERE r.group_id = sg.id AND r.status = 'trained')), "
        "sum(EXISTS (SELECT 1 FROM runs r WHERE r.group_id = sg.id AND r.status = 'skipped')) "
        "FROM sibling_groups sg GROUP BY sg.reason ORDER BY sg.reason",
    )
    keys = ("made", "scored", "failed", "trained", "skipped")
    by_reason = {
        reason: dict(zip(keys, (int(v or 0) for v in counts), strict=True)) for reason, *counts in made
    }
    total = {k: sum(r[k] for r in by_reason.values()) for k in keys}
    app = _read(
        db,
        "SELECT sum(trained), sum(skipped AND NOT trained), sum(skipped AND NOT trained AND rescued) FROM ("
        "SELECT max(r.status = 'trained') AS trained, "
        "max(r.status = 'skipped' AND r.status_reason = 'zero_variance') AS skipped, "
        "max(EXISTS (SELECT 1 FROM sibling_groups sg JOIN runs m ON m.group_id = sg.id "
        "WHERE sg.run_id = r.id AND m.status = 'trained')) AS rescued "
        "FROM runs r WHERE r.branch_of IS NULL AND r.split = 'train' GROUP BY r.group_id)",
    )
    trained, skipped, rescued = (int(v or 0) for v in (app[0] if app else (0, 0, 0)))
    return {
        "sibling_groups": total,
        "by_reason": by_reason,
        "app_groups": {"trained": trained, "skipped_zero_variance": skipped, "rescued_by_siblings": rescued},
    }
