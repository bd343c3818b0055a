"""The pace a demo gets on a machine that is doing other things, and what to say when it falls short.

`make demo` plans its time for a quiet laptop. On a busy one (a build, a browser, two `yes` loops)
it gets a share of the CPU, each group takes longer, and the planned minutes end before the goal.
`CpuShare` measures that share: the CPU seconds of the demo and its `serve` (and their children)
against the machine's busy seconds, and how many cores other processes kept busy meanwhile. When
the planned time is up without the goal and others took at least `BUSY_CORES` cores, the demo
extends its time once, up to `CEILING_MINUTES` in all (a quiet machine never extends: unchanged);
when it still falls short, `shortfall` says why (the CPU share, the groups skipped and their
reason) and the next step.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import psutil

CEILING_MINUTES = 15.0  # the most a demo runs in all, extension included
BUSY_CORES = 0.5  # cores other processes kept busy on average: a busy machine, worth extending for

_REASONS = {
    "zero_variance": "every episode of the group got the same reward: nothing to learn from it",
}


class CpuShare:
    """CPU seconds of this process, `pid` and their children, against the whole machine's."""

    def __init__(self, pid: int) -> None:
        self.procs = [psutil.Process(), psutil.Process(pid)]
        self.wall0, self.machine0, self.ours0 = time.monotonic(), self._machine(), self._ours()

    def _ours(self) -> float:
        seen: dict[int, psutil.Process] = {}  # by pid: `serve` is this process's child, counted once
        for proc in self.procs:
            try:
                seen |= {p.pid: p for p in [proc, *proc.children(recursive=True)]}
            except psutil.Error:  # gone (serve stopped): what it used is no longer counted
                continue
        total = 0.0
        for p in seen.values():
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    @staticmethod
    def _machine() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def read(self) -> dict[str, float]:
        """`share`: our part of the CPU seconds spent since start (0-1); `others_cores`: cores that
        other processes kept busy on average; `cores`: the machine's."""
        wall = max(time.monotonic() - self.wall0, 1e-6)
        machine = max(self._machine() - self.machine0, 1e-6)
        ours = min(self._ours() - self.ours0, machine)
        return {
            "share": round(ours / machine, 3),
            "others_cores": round((machine - ours) / wall, 2),
            "cores": float(psutil.cpu_count() or 1),
        }


def extend_to(minutes: float, cpu: dict[str, float]) -> float | None:
    """The minutes to extend a demo to when its planned `minutes` are up without the goal: the
    ceiling when others kept the machine busy and there is room left, else None (stop now)."""
    if cpu["others_cores"] >= BUSY_CORES and minutes < CEILING_MINUTES:
        return CEILING_MINUTES
    return None


def shortfall(summary: dict[str, Any], goal: float) -> str:
    """Why a demo did not reach its goal, and the next step, in a few lines."""
    rows = summary.get("rows") or []
    lines = [
        f"The goal (+{goal} mean reward) was not reached in {summary.get('minutes', 0):.1f} min "
        f"({summary.get('improvement') or 0.0:+.3f}; see summary.json)."
    ]
    cpu = summary.get("cpu")
    if cpu:
        lines.append(
            f"  CPU: the demo got {cpu['share']:.0%} of the CPU time spent; other processes kept "
            f"{cpu['others_cores']:.1f} of {cpu['cores']:.0f} cores busy."
        )
    skipped = Counter(r.get("reason") or r["status"] for r in rows if r["status"] != "trained")
    for reason, n in skipped.items():
        lines.append(f"  {n} of {len(rows)} groups not trained ({reason}): {_REASONS.get(reason, reason)}.")
    busy = bool(cpu) and cpu["others_cores"] >= BUSY_CORES
    lines.append(
        "  Next: stop the other work (or run it later) and `make demo` again, or give it more time: "
        "`rlproxy demo --minutes 20`."
        if busy
        else "  Next: give it more time (`rlproxy demo --minutes 20`) or another seed (`--seed 1`)."
    )
    return "\n".join(lines)
