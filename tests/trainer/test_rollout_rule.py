"""The canary decision rule on simulated arms (seeded): false-promote rate, time to rollback, errors.

The simulation replays what a canary sees: runs arrive one at a time, each lands on the candidate with
probability `fraction`, its reward is drawn from its arm's distribution, and the rule is asked whenever
a look is due (asking after every run changes nothing: it may only *act* at its fixed looks). Equal arms must
be promoted at most `alpha` of the time over all looks (the stated level, docs/rollout.md).
"""

from __future__ import annotations

import math
import random

import pytest

from rlproxy.settings import RolloutSettings, parse_rollout
from rlproxy.storage.rollouts import ArmRun, mode_of
from rlproxy.trainer.rollout_rule import decide, errors_z, t_sf, welch

CFG = RolloutSettings(canary_min_runs=30, canary_looks=4, canary_alpha=0.05, canary_min_pairs=10)


def simulate(
    rng: random.Random,
    p_cand: float,
    p_inc: float,
    cfg: RolloutSettings = CFG,
    fraction: float = 0.2,
    max_runs: int = 5000,
    groups: int = 0,
    err_cand: float = 0.0,
) -> tuple[str, int]:
    """(decision, runs that arrived before it) of one simulated canary with Bernoulli rewards."""
    cand: list[ArmRun] = []
    inc: list[ArmRun] = []
    looks = nc = ni = 0
    for n in range(1, max_runs + 1):
        on_cand = rng.random() < fraction
        g = f"g{rng.randrange(groups)}" if groups else None
        p = p_cand if on_cand else p_inc
        errored = on_cand and rng.random() < err_cand
        reward = None if errored else float(rng.random() < p)
        (cand if on_cand else inc).append(ArmRun(g, reward, errored))
        rewarded = on_cand and reward is not None
        nc = nc + rewarded
        ni = ni + (not on_cand)
        if min(nc, ni) < (looks + 1) * cfg.canary_min_runs:  # decide() would say "collecting" (saves time)
            continue
        v = decide(cand, inc, looks, cfg)
        looks = v.look
        if v.decision != "continue":
            return v.decision, n
    return "continue", max_runs


def test_t_tail_matches_tables() -> None:
    # Student's t upper tails from standard tables
    assert t_sf(2.228, 10) == pytest.approx(0.025, abs=2e-4)
    assert t_sf(1.0, 1) == pytest.approx(0.25, abs=1e-9)
    assert t_sf(-1.697, 30) == pytest.approx(0.95, abs=3e-4)
    assert t_sf(1.96, 1e6) == pytest.approx(0.025, abs=2e-4)


def test_welch_matches_hand_computation() -> None:
    t, df = welch([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 2.0])
    # means 2.5 vs 4/3, variances 5/3 and 1/3: se^2 = 5/12 + 1/9
    assert t == pytest.approx((2.5 - 4 / 3) / math.sqrt(5 / 12 + 1 / 9))
    assert df == pytest.approx((5 / 12 + 1 / 9) ** 2 / ((5 / 12) ** 2 / 3 + (1 / 9) ** 2 / 2))


def test_false_promote_rate_on_equal_arms_is_within_alpha() -> None:
    rng = random.Random(20261201)
    trials = 2000
    outcomes = [simulate(rng, 0.5, 0.5)[0] for _ in range(trials)]
    promoted = outcomes.count("promote") / trials
    print(f"equal arms: promoted {promoted:.4f}, rolled back {outcomes.count('rollback') / trials:.4f}")
    assert promoted <= CFG.canary_alpha  # measured 0.0305: Bonferroni over 4 looks is conservative
    assert "continue" not in outcomes  # every canary ends by the last look


def test_peeking_after_every_run_would_inflate_false_promotes() -> None:
    # the same data tested at alpha after every run (no fixed looks): what the looks protect against
    rng = random.Random(7)
    promoted = 0
    for _ in range(300):
        cand: list[float] = []
        inc: list[float] = []
        for _ in range(600):
            (cand if rng.random() < 0.2 else inc).append(float(rng.random() < 0.5))
            if len(cand) >= 30 and len(inc) >= 30:
                t, df = welch(cand, inc)
                if t_sf(t, df) < 0.05:
                    promoted += 1
                    break
    assert promoted / 300 > 0.10  # several times the nominal 5%


def test_collapse_of_0_3_is_rolled_back_in_a_measured_number_of_runs() -> None:
    rng = random.Random(28)
    results = [simulate(rng, 0.4, 0.7) for _ in range(500)]
    decisions = [d for d, _ in results]
    runs = sorted(n for d, n in results if d == "rollback")
    median, p90 = runs[len(runs) // 2], runs[int(len(runs) * 0.9)]
    print(f"0.7 -> 0.4: rolled back {len(runs) / 500:.3f}, runs to rollback median {median}, p90 {p90}")
    assert decisions.count("rollback") / 500 >= 0.99
    assert decisions.count("promote") == 0
    # fraction 0.2, min_runs 30: the first look comes at ~150 runs, the second at ~300
    assert median <= 200 and p90 <= 350


def test_a_better_candidate_is_promoted() -> None:
    rng = random.Random(3)
    decisions = [simulate(rng, 0.8, 0.5)[0] for _ in range(200)]
    assert decisions.count("promote") / 200 >= 0.95


def test_paired_by_group_when_groups_land_on_both_arms() -> None:
    # 20 tasks of very different difficulty; the candidate is +0.1 on each: pairing removes the spread
    rng = random.Random(5)
    cand, inc = [], []
    for g in range(20):
        base = g / 20
        for _ in range(8):
            inc.append(ArmRun(f"g{g}", base + rng.gauss(0, 0.02)))
        for _ in range(2):
            cand.append(ArmRun(f"g{g}", base + 0.1 + rng.gauss(0, 0.02)))
    v = decide(cand, inc, 0, RolloutSettings(canary_min_runs=30, canary_looks=4, canary_min_pairs=10))
    assert v.statistic == "paired_t" and v.stats["pairs"] == 20
    assert v.decision == "promote"
    # unpaired, the task spread hides the same difference
    unpaired = decide(
        cand, inc, 0, RolloutSettings(canary_min_runs=30, canary_looks=4, canary_min_pairs=1000)
    )
    assert unpaired.statistic == "welch_t" and unpaired.decision == "continue"


def test_errors_alone_roll_back_even_when_rewarded_runs_look_equal() -> None:
    rng = random.Random(11)
    decision, _ = simulate(rng, 0.5, 0.5, err_cand=0.3)
    assert decision == "rollback"
    cand = [ArmRun(None, 0.5, errored=i < 12) for i in range(40)]
    inc = [ArmRun(None, 0.5, errored=i < 2) for i in range(160)]
    v = decide(cand, inc, 0, CFG)
    assert v.decision == "rollback" and v.statistic == "errors_z", v.reason
    assert errors_z(12, 40, 2, 160) > 4


def test_no_look_before_min_runs_and_one_look_at_a_time() -> None:
    cand = [ArmRun(None, 0.0)] * 29
    inc = [ArmRun(None, 1.0)] * 500
    assert decide(cand, inc, 0, CFG).decision == "continue"
    assert decide(cand, inc, 0, CFG).look == 0
    cand = [ArmRun(None, float(i % 2)) for i in range(200)]
    inc = [ArmRun(None, float(i % 2)) for i in range(800)]
    v = decide(cand, inc, 1, CFG)  # enough for look 4, but only look 2 is taken
    assert v.look == 2 and v.decision == "continue"
    last = decide(cand, inc, 3, CFG)
    assert last.look == 4 and last.decision == "rollback" and "inconclusive" in last.reason
    promote = decide(cand, inc, 3, RolloutSettings(canary_inconclusive="promote"))
    assert promote.decision == "promote"


def test_modes() -> None:
    assert parse_rollout("canary") == {"*": "canary"}
    modes = parse_rollout("agent=canary,*=immediate")
    assert mode_of(modes, "agent") == "canary" and mode_of(modes, "other") == "immediate"
    assert mode_of(parse_rollout("immediate"), "x") == "immediate"
    with pytest.raises(ValueError, match="rollout entry"):
        parse_rollout("agent=fast")
