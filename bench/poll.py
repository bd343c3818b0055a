"""The trainer's poll with many lone runs: flat from 1k to 100k, against the 1k baseline of the same run.

    .venv/bin/python bench/poll.py [--quick] [--sizes 1000,10000,100000] [--rounds N] [--polls N]

Live traffic leaves one run per group. Before issue 17 such runs stayed `completed` forever and every
poll grouped all of them again (`ready_groups`: a GROUP BY over every completed run). Now a lone run
becomes `ungrouped` once, and the poll reads only runs of one status from an index.

Method. For each size N, one SQLite file (migrated to head, WAL) holding N `ungrouped` runs (each its
own group, one small completion each: what live traffic leaves behind), plus the same live set in
every file: 50 lone runs still within group_timeout and 5 groups of 3 waiting for a 4th. Rows are
bulk-inserted with sqlite3's executemany. One poll = what TrainerService._select reads when nothing
is ready: `ungroup_runs` + `ready_groups` (singletons=ungrouped, the default), and, with
singletons=train, also `ungrouped_batch` (which then finds a full batch of 16: its read is measured).
For contrast the old poll is timed too: `ready_groups` over a file where the same N lone runs are
still `completed` (what the store looked like before this change). Each measure warms up, then the
sizes alternate in rounds (N1, N2, N3, N1, ...), `--polls` polls per slice; the figures are the
median and the best poll in milliseconds, each with its ratio to the smallest size of the same run.
Goal: the new polls' best at 100k <= 1.5 x the best at 1k (flat; the best is the poll least
disturbed by other work on a shared machine, the median is printed too); the old poll grows with N.
The files are ANALYZEd: the harder case for SQLite's planner (storage.training._status_is).
Also printed, once per size: the first poll after an upgrade, which moves all N lone `completed`
runs to `ungrouped` in one transaction (paid once, not per poll).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlproxy.storage.db import create_engine, upgrade  # noqa: E402
from rlproxy.storage.training import ready_groups, ungroup_runs, ungrouped_batch  # noqa: E402

TIMEOUT = 600.0  # group_timeout, seconds
GROUP_SIZE = 4
BATCH = 16
GOAL = 1.5


def _ts(t: datetime) -> str:
    return t.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ")


def populate(path: Path, n: int, lone_status: str) -> None:
    """N lone runs (status `lone_status`, an hour old) and the fixed live set; one completion each."""
    upgrade(f"sqlite+aiosqlite:///{path}")
    rng = random.Random(0)
    now = datetime.now(UTC)
    runs, comps = [], []

    def add(run_id: str, group: str, status: str, ago: float, reason: str | None = None) -> None:
        at = now - timedelta(seconds=ago)
        runs.append(
            (run_id, group, "p", status, rng.random(), _ts(at - timedelta(seconds=5)), _ts(at), reason)
        )
        comps.append(
            (run_id, 0, "p", 0, "ok", "[1, 2, 3, 4]", "[[5, 6, 7]]", "[[-0.5, -0.25, -1.0]]", _ts(at))
        )

    for i in range(n):  # what live traffic leaves behind
        reason = "no_sibling" if lone_status == "ungrouped" else None
        add(f"lone-{i:07d}", f"task-{i:07d}", lone_status, 3600 + i * 0.01, reason)
    for i in range(50):  # fresh lone runs: a sibling may still come
        add(f"fresh-{i}", f"fresh-{i}", "completed", 10 + i)
    for g in range(5):  # groups waiting for their 4th run
        for j in range(3):
            add(f"wait-{g}-{j}", f"wait-{g}", "completed", 30 + j)
    con = sqlite3.connect(path)
    try:
        con.executemany(
            "INSERT INTO runs (id, group_id, policy, status, reward, created_at, completed_at, "
            "status_reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            runs,
        )
        con.executemany(
            "INSERT INTO completions (run_id, seq, policy, policy_step, status, prompt_token_ids, token_ids, "
            "logprobs, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            comps,
        )
        con.commit()
        con.execute("ANALYZE")
    finally:
        con.close()


Poll = Callable[[object], Awaitable[object]]


async def poll_default(engine: object) -> None:
    await ungroup_runs(engine, group_timeout=TIMEOUT)  # type: ignore[arg-type]
    await ready_groups(engine, group_size=GROUP_SIZE, group_timeout=TIMEOUT)  # type: ignore[arg-type]


async def poll_train(engine: object) -> None:
    await poll_default(engine)
    await ungrouped_batch(engine, batch_size=BATCH, wait=2 * TIMEOUT)  # type: ignore[arg-type]


async def poll_old(engine: object) -> None:
    await ready_groups(engine, group_size=GROUP_SIZE, group_timeout=TIMEOUT)  # type: ignore[arg-type]


async def measure(files: dict[int, Path], poll: Poll, rounds: int, polls: int) -> dict[int, list[float]]:
    """Poll milliseconds per size, the sizes alternating in rounds after a warm-up."""
    engines = {n: create_engine(f"sqlite+aiosqlite:///{p}") for n, p in files.items()}
    times: dict[int, list[float]] = {n: [] for n in files}
    try:
        for eng in engines.values():  # warm up: connections, page cache, statement cache
            for _ in range(5):
                await poll(eng)
        for _ in range(rounds):
            for n, eng in engines.items():
                for _ in range(polls):
                    t0 = time.perf_counter()
                    await poll(eng)
                    times[n].append((time.perf_counter() - t0) * 1000)
    finally:
        for eng in engines.values():
            await eng.dispose()
    return times


async def first_poll(path: Path) -> tuple[int, float]:
    """The one poll after an upgrade that moves every lone completed run to `ungrouped`."""
    eng = create_engine(f"sqlite+aiosqlite:///{path}")
    try:
        t0 = time.perf_counter()
        moved = await ungroup_runs(eng, group_timeout=TIMEOUT)
        return moved, (time.perf_counter() - t0) * 1000
    finally:
        await eng.dispose()


def report(name: str, times: dict[int, list[float]], goal: float | None) -> bool:
    """One line per poll kind: median and best poll per size, each with its ratio to the smallest size."""
    small, big = min(times), max(times)
    med = {n: statistics.median(v) for n, v in times.items()}
    best = {n: min(v) for n, v in times.items()}
    print(name)
    for n in times:
        print(
            f"  {n:>7,} runs: median {med[n]:7.2f} ms (x{med[n] / med[small]:5.2f})   "
            f"best {best[n]:7.2f} ms (x{best[n] / best[small]:5.2f})"
        )
    if goal is None:
        return True
    worst = best[big] / best[small]
    print(f"  goal: best at {big:,} <= x{goal} of best at {small:,}: {'ok' if worst <= goal else 'MISSED'}")
    return worst <= goal


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--sizes", default="1000,10000,100000", help="comma list of lone-run counts")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; quick 2)")
    ap.add_argument("--polls", type=int, default=None, help="polls per size per round (default 20; quick 10)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rounds = args.rounds or (2 if args.quick else 5)
    polls = args.polls or (10 if args.quick else 20)
    with tempfile.TemporaryDirectory(prefix="rlproxy-poll-") as tmp:
        new, old = {}, {}
        t0 = time.perf_counter()
        for n in sizes:
            new[n] = Path(tmp) / f"ungrouped-{n}.db"
            old[n] = Path(tmp) / f"completed-{n}.db"
            populate(new[n], n, "ungrouped")
            populate(old[n], n, "completed")
        print(
            f"populated {2 * len(sizes)} SQLite files in {time.perf_counter() - t0:.1f} s "
            f"(sizes {sizes}; + 50 fresh lone runs and 5 waiting groups each)"
        )
        print(f"poll time, {rounds} rounds x {polls} polls per size, ratio to {min(sizes):,} runs:")
        ok = report("poll (singletons=ungrouped)", await measure(new, poll_default, rounds, polls), GOAL)
        ok &= report("poll (singletons=train)", await measure(new, poll_train, rounds, polls), GOAL)
        report("old poll (lone runs left completed)", await measure(old, poll_old, rounds, polls), None)
        for n in sizes:  # destroys the old files' state: last
            moved, ms = await first_poll(old[n])
            print(
                f"first poll after an upgrade, {n:>7,}: {moved:,} lone runs ungrouped in {ms:.0f} ms (once)"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
