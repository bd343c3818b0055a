"""proxy/rollout.py Router: the split is a pure function of run id + rollout row, sticky per run;
untagged requests get the incumbent; a rolled-back step is never served by the policy's name."""

from __future__ import annotations

from rlproxy.proxy.policies import Policies
from rlproxy.proxy.rollout import Router, assign
from rlproxy.storage.rollouts import OpenRollout, PolicyRollouts

OPEN = PolicyRollouts(max_step=3, open=OpenRollout(7, 3, 2, 0.2), stable=2)


def _router(snap: PolicyRollouts = OPEN, modes: dict[str, str] | None = None) -> Router:
    r = Router(modes or {"*": "canary"})
    r.snap = {"p": snap}
    return r


def test_split_is_within_5_points_and_the_same_on_every_replica() -> None:
    a, b = _router(), _router()  # two proxy replicas that never talk
    ids = [f"run-{i}" for i in range(2000)]
    steps_a = [a.route("p", 3, rid) for rid in ids]
    steps_b = [b.route("p", 3, rid) for rid in reversed(ids)][::-1]
    assert steps_a == steps_b
    share = steps_a.count(3) / len(ids)
    assert abs(share - 0.2) <= 0.05, share
    assert set(steps_a) == {2, 3}
    assert a.assigned == {("p", "candidate"): steps_a.count(3), ("p", "incumbent"): steps_a.count(2)}


def test_every_turn_of_a_run_on_one_step() -> None:
    r = _router()
    for rid in (f"r{i}" for i in range(200)):
        first = r.route("p", 3, rid)
        assert all(r.route("p", 3, rid) == first for _ in range(5))
        assert first == (3 if assign(7, rid, 0.2) else 2)


def test_a_run_that_began_before_the_rollout_stays_on_its_step() -> None:
    r = _router(PolicyRollouts(max_step=2, stable=2))
    early = [f"e{i}" for i in range(100) if assign(7, f"e{i}", 0.2)]  # would hash to the candidate
    assert early and all(r.route("p", 2, rid) == 2 for rid in early)
    r.snap = {"p": OPEN}  # step 3 published, its canary opened
    assert all(r.route("p", 3, rid) == 2 for rid in early)
    assert r.route("p", 3, None) == 2  # untagged: the incumbent


def test_a_step_newer_than_the_snapshot_waits_and_a_rolled_back_step_is_never_served() -> None:
    r = _router(PolicyRollouts(max_step=2, stable=2))
    assert {r.route("p", 3, f"x{i}") for i in range(300)} == {2}  # committed, rollout not seen yet
    r.snap = {"p": PolicyRollouts(max_step=3, rejected=frozenset({3}), stable=2)}
    assert {r.route("p", 3, f"y{i}") for i in range(300)} == {2}
    # immediate mode: today's routing, except that a rolled-back step stays unserved
    imm = _router(PolicyRollouts(max_step=3, rejected=frozenset({3}), stable=2), {"*": "immediate"})
    assert imm.route("p", 3, "z") == 2 and imm.route("p", 4, "z") == 4


def test_policies_resolve_asks_the_router() -> None:
    pol = Policies("base")
    pol.steps["p"] = 3
    assert pol.resolve("p", "r1") == ("p", 3, "p@3")  # no router: immediate, as before
    pol.router = _router()
    rid = next(f"r{i}" for i in range(100) if not assign(7, f"r{i}", 0.2))
    assert pol.resolve("p", rid) == ("p", 2, "p@2")
    assert pol.resolve("p@3", rid) == ("p", 3, "p@3")  # a pin is a pin
    assert pol.resolve("p") == ("p", 2, "p@2")


def test_metrics_collect() -> None:
    r = _router()
    r.rows = [
        {
            "id": 7,
            "policy": "p",
            "status": "canary",
            "candidate_runs": 5,
            "incumbent_runs": 20,
            "candidate_reward": 0.5,
            "incumbent_reward": 0.25,
        }
    ]
    r.route("p", 3, "a")
    names = {m.name: m for m in r.collect()}
    assert names["rlproxy_rollout_fraction"].samples[0].value == 0.2
    rewards = {s.labels["arm"]: s.value for s in names["rlproxy_rollout_arm_reward"].samples}
    assert rewards == {"candidate": 0.5, "incumbent": 0.25}


def test_runs_in_flight_at_a_promotion_finish_on_their_step_but_never_on_a_rolled_back_one() -> None:
    r = _router()
    ids = [f"f{i}" for i in range(200)]
    first = {rid: r.route("p", 3, rid) for rid in ids}
    r.snap = {"p": PolicyRollouts(max_step=3, stable=3, previous=2)}  # 3 promoted over 2
    assert all(r.route("p", 3, rid) == first[rid] for rid in ids)
    assert r.route("p", 3, "new-run") == 3
    r = _router()
    first = {rid: r.route("p", 3, rid) for rid in ids}
    r.snap = {"p": PolicyRollouts(max_step=3, rejected=frozenset({3}), stable=2)}  # 3 rolled back
    assert {r.route("p", 3, rid) for rid in ids} == {2}


def test_the_first_step_of_a_policy_waits_for_its_rollout_too() -> None:
    r = Router({"*": "canary"})  # the snapshot knows no step of p yet
    assert {r.route("p", 1, f"n{i}") for i in range(100)} == {0}
    r.snap = {"p": PolicyRollouts(max_step=1, open=OpenRollout(1, 1, 0, 0.3), stable=0)}
    assert {r.route("p", 1, f"n{i}") for i in range(100)} == {0}  # they began on the base model


def test_assignment_is_uniform_in_run_ids() -> None:
    # 100k ids: the share is the fraction to within 3 standard errors (0.0015 each); a window of
    # 200 runs is binomial (sd 0.032 at 0.3): +-5 points holds for ~88% of such windows, not all
    n = 100_000
    for fraction in (0.05, 0.3, 0.5):
        share = sum(assign(11, f"w{i}", fraction) for i in range(n)) / n
        assert abs(share - fraction) <= 3 * (fraction * (1 - fraction) / n) ** 0.5, (fraction, share)
