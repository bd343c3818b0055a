"""Which groups of a step can make it non-finite, so that only they fail (issue 22, case 3).

A step whose loss or gradient is not finite is skipped and tried again; after NONFINITE_RETRIES
(trainer/service.py) its runs are marked `failed`. A step holds several groups, perhaps of several
tenants: `nonfinite_groups` names the runs of the groups that carry the cause, read from the data
alone: a reward that is not finite, a group whose rewards' spread or variance overflows a float
(two rewards near 1e308), or a sampled token whose stored logprob is NaN or +/-inf (an importance
ratio of inf). Only those runs fail; the others stay trainable. When no group carries a visible
cause (the model itself diverged), every run of the step fails, as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from rlproxy.storage.training import RunData
from rlproxy.trainer.batches import baseline_group


def _rewards_overflow(rewards: list[float]) -> bool:
    if not all(math.isfinite(r) for r in rewards):
        return True
    try:
        mean = math.fsum(rewards) / len(rewards)
        var = math.fsum((r - mean) ** 2 for r in rewards) / len(rewards)
    except OverflowError:
        return True
    return not (math.isfinite(mean) and math.isfinite(var) and math.isfinite(max(rewards) - min(rewards)))


def _bad_logprobs(lists: Iterable[object]) -> bool:
    for per_choice in lists or ():
        for lp in per_choice or ():
            if lp is not None and not math.isfinite(lp):
                return True
    return False


def nonfinite_groups(runs: list[RunData]) -> set[str]:
    """The run ids of the groups of `runs` (their baseline groups) that can make a step non-finite."""
    groups: dict[object, list[RunData]] = {}
    for run in runs:
        groups.setdefault(baseline_group(run), []).append(run)
    out: set[str] = set()
    for members in groups.values():
        bad = _rewards_overflow([r.reward for r in members]) or any(
            _bad_logprobs(c.logprobs or ()) for r in members for c in r.completions
        )
        if bad:
            out.update(r.run_id for r in members)
    return out
