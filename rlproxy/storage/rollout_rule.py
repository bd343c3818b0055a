"""The canary decision rule: pure functions, no I/O (issue 28; docs/rollout.md "The rule").

A canary compares the candidate arm (runs served by the new step) with the incumbent arm (runs served
by the step the policy served before). It looks at the data at most `looks` times, at
k * `min_runs` rewarded runs in *each* arm (k = 1..looks), and at each look it spends alpha / looks
(Bonferroni alpha spending): by the union bound the chance of ever promoting a candidate that is no
better than the incumbent is <= alpha, however correlated the looks are (the sequential peeking
that would inflate a test run after every new reward is what the fixed looks rule out).

At a look, in order:
1. errors: the share of the candidate's runs with a 5xx (an upstream error), a completion cut at
   its length bound (finish_reason `length`) or a malformed tool call, against the incumbent's.
   A one-sided two-proportion z-test at alpha / looks AND an excess of at least `error_margin`
   rolls back on errors alone.
2. reward, paired when the arms share at least `min_pairs` groups (a group's runs landed on both
   arms: the same task on both steps), else unpaired:
   - paired: a one-sided t-test on the per-group differences d_g = mean_c(g) - mean_i(g) (df = G - 1);
     pairing removes the task's difficulty from the noise;
   - unpaired: Welch's t-test (unequal variances and sizes: the arms differ in size by design,
     canary_fraction), Welch-Satterthwaite df.
   p(up) < alpha/looks promotes; p(down) < alpha/looks rolls back.
3. the last look with neither: `inconclusive` decides (rollback by default: a step that has not
   shown it is better does not take all the traffic; `promote` trades the false-promote bound for
   progress and is said so in the reason).

The t-distribution's tail comes from the regularized incomplete beta function (Numerical Recipes'
continued fraction), so the rule needs nothing beyond the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RuleConfig:
    """The rule's knobs (Settings fields canary_*)."""

    min_runs: int = 30  # rewarded runs per arm before the first look; look k at k * min_runs
    looks: int = 4  # looks at most; each spends alpha / looks
    alpha: float = 0.05  # the false-promote bound (and the false-rollback bound) over all looks
    min_pairs: int = 10  # groups on both arms for the paired test
    error_margin: float = 0.05  # error-rate excess (absolute) that may roll back on errors alone
    inconclusive: str = "rollback"  # rollback | promote at the last look without a significant result
    max_key_share: float = 1.0  # most of an arm one app key's runs may be (1 = no cap; `cap_keys`)


@dataclass(frozen=True)
class ArmRun:
    """One run of an arm: its group, its reward (None: not rewarded yet), whether it errored."""

    group_id: str | None
    reward: float | None
    errored: bool = False
    key_id: str | None = None  # the app key that made it (None: the shared agents' key)


@dataclass
class Verdict:
    """The outcome of one look (or of no look: `look` 0 while collecting)."""

    decision: str  # continue | promote | rollback
    reason: str
    look: int = 0
    statistic: str | None = None  # welch_t | paired_t | errors_z
    value: float | None = None  # the statistic
    p_value: float | None = None  # one-sided, in the direction of the decision (p(up) otherwise)
    stats: dict[str, float] = field(default_factory=dict)  # per arm: runs, reward, error rate


# ------------------------------------------------------------------ distributions


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (Lentz's method)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-12:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbeta) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbeta) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom."""
    if math.isnan(t):
        return 0.5
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t > 0 else 1.0 - tail


def norm_sf(z: float) -> float:
    """P(Z > z) for a standard normal."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


# ------------------------------------------------------------------ tests


def _mean_var(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    v = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, v


def welch(c: Sequence[float], i: Sequence[float]) -> tuple[float, float]:
    """Welch's t statistic of mean(c) - mean(i) and its Welch-Satterthwaite df (both arms >= 2 runs)."""
    mc, vc = _mean_var(c)
    mi, vi = _mean_var(i)
    sc, si = vc / len(c), vi / len(i)
    se2 = sc + si
    if se2 <= 0.0:  # no variance at all: the sign of the difference is the whole story
        return (math.copysign(math.inf, mc - mi) if mc != mi else 0.0), float(len(c) + len(i) - 2)
    df = se2 * se2 / ((sc * sc) / (len(c) - 1) + (si * si) / (len(i) - 1)) if sc or si else 1.0
    return (mc - mi) / math.sqrt(se2), max(df, 1.0)


def paired(diffs: Sequence[float]) -> tuple[float, float]:
    """The one-sample t statistic of the per-group differences and its df (>= 2 differences)."""
    m, v = _mean_var(diffs)
    if v <= 0.0:
        return (math.copysign(math.inf, m) if m else 0.0), float(len(diffs) - 1)
    return m / math.sqrt(v / len(diffs)), float(len(diffs) - 1)


def errors_z(ec: int, nc: int, ei: int, ni: int) -> float:
    """Two-proportion z statistic of error rate(candidate) - error rate(incumbent), pooled variance."""
    p = (ec + ei) / (nc + ni)
    se = math.sqrt(p * (1 - p) * (1 / nc + 1 / ni)) if 0 < p < 1 else 0.0
    diff = ec / nc - ei / ni
    if se == 0.0:
        return math.copysign(math.inf, diff) if diff else 0.0
    return diff / se


def group_diffs(cand: Sequence[ArmRun], inc: Sequence[ArmRun]) -> list[float]:
    """mean_c(g) - mean_i(g) for every group with rewarded runs on both arms."""
    by: dict[str, tuple[list[float], list[float]]] = {}
    for arm, runs in ((0, cand), (1, inc)):
        for r in runs:
            if r.reward is not None and r.group_id is not None:
                by.setdefault(r.group_id, ([], []))[arm].append(r.reward)
    return [sum(c) / len(c) - sum(i) / len(i) for c, i in by.values() if c and i]


# ------------------------------------------------------------------ the rule


def cap_keys(runs: Sequence[ArmRun], share: float) -> list[ArmRun]:
    """`runs` (oldest first) with each app key's runs beyond `share` of the arm left out.

    The share is of the arm as it is used: each key keeps at most c runs, its oldest, where c is
    the largest number with c <= share * (the runs kept), found by iterating c from share * all runs
    down to its fixed point. So one key cannot outweigh the others however many runs it makes
    (at 0.5 it keeps at most as many as all the others together). Runs of the shared agents' key
    (key_id None: a one-app deployment) are never capped."""
    if share >= 1.0:
        return list(runs)
    counts: dict[str, int] = {}
    shared = 0
    for r in runs:
        if r.key_id is None:
            shared += 1
        else:
            counts[r.key_id] = counts.get(r.key_id, 0) + 1
    cap = share * len(runs)
    for _ in range(200):
        kept = shared + sum(min(n, cap) for n in counts.values())
        new = share * kept
        if cap - new < 1e-9:
            break
        cap = new
    limit = math.floor(cap + 1e-9)
    taken: dict[str, int] = {}
    out = []
    for r in runs:
        if r.key_id is not None:
            if taken.get(r.key_id, 0) >= limit:
                continue
            taken[r.key_id] = taken.get(r.key_id, 0) + 1
        out.append(r)
    return out


def decide(cand: Sequence[ArmRun], inc: Sequence[ArmRun], looks_done: int, cfg: RuleConfig) -> Verdict:
    """The verdict on the arms' runs so far, given the looks already taken (see the module doc)."""
    cand, inc = cap_keys(cand, cfg.max_key_share), cap_keys(inc, cfg.max_key_share)
    rc = [r.reward for r in cand if r.reward is not None]
    ri = [r.reward for r in inc if r.reward is not None]
    stats = {
        "candidate_runs": float(len(rc)),
        "incumbent_runs": float(len(ri)),
        "candidate_reward": sum(rc) / len(rc) if rc else math.nan,
        "incumbent_reward": sum(ri) / len(ri) if ri else math.nan,
        "candidate_error_rate": sum(r.errored for r in cand) / len(cand) if cand else math.nan,
        "incumbent_error_rate": sum(r.errored for r in inc) / len(inc) if inc else math.nan,
    }
    n = min(len(rc), len(ri))
    look = n // max(cfg.min_runs, 2)  # the look the data reached (1 = first)
    if look <= looks_done or looks_done >= cfg.looks:
        need = (looks_done + 1) * max(cfg.min_runs, 2)
        reason = f"collecting: {n} of {need} rewarded runs per arm"
        return Verdict("continue", reason, looks_done, stats=stats)
    look = looks_done + 1  # one look at a time: a look skipped by a burst of rewards is still spent
    a = cfg.alpha / cfg.looks

    # 1. errors alone
    ec, ei = sum(r.errored for r in cand), sum(r.errored for r in inc)
    if cand and inc:
        z = errors_z(ec, len(cand), ei, len(inc))
        excess = ec / len(cand) - ei / len(inc)
        if norm_sf(z) < a and excess >= cfg.error_margin:
            return Verdict(
                "rollback",
                f"errors: {ec}/{len(cand)} candidate runs vs {ei}/{len(inc)} incumbent (z={z:.2f})",
                look,
                "errors_z",
                z,
                norm_sf(z),
                stats,
            )

    # 2. reward: paired by group when enough groups landed on both arms
    diffs = group_diffs(cand, inc)
    if len(diffs) >= max(cfg.min_pairs, 2):
        name, (t, df) = "paired_t", paired(diffs)
        stats["pairs"] = float(len(diffs))
    else:
        name, (t, df) = "welch_t", welch(rc, ri)
    p_up, p_down = t_sf(t, df), t_sf(-t, df)
    diff = stats["candidate_reward"] - stats["incumbent_reward"]
    what = f"{name}={t:.2f} (df {df:.0f}), reward {diff:+.3f}, look {look}/{cfg.looks} at alpha {a:.4f}"
    if p_up < a:
        return Verdict("promote", f"better: {what}, p={p_up:.4f}", look, name, t, p_up, stats)
    if p_down < a:
        return Verdict("rollback", f"worse: {what}, p={p_down:.4f}", look, name, t, p_down, stats)
    if look >= cfg.looks:
        decision = "promote" if cfg.inconclusive == "promote" else "rollback"
        return Verdict(decision, f"inconclusive after the last look: {what}", look, name, t, p_up, stats)
    return Verdict("continue", f"no difference yet: {what}", look, name, t, p_up, stats)


# ------------------------------------------------------------------ modes


def mode_of(modes: dict[str, str], policy: str) -> str:
    """The rollout mode of `policy` (its own entry, else `*`, else immediate)."""
    return modes.get(policy, modes.get("*", "immediate"))
