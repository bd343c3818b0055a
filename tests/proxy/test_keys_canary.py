"""Issue 55, item 2: no single app steers a canary.

The issue's attack, through a real proxy on the stub upstream: while `stub-model@1` is in canary
against step 0, one app pins its runs to the candidate (`"model": "stub-model@1"`) and rewards them
1.0, while the incumbent's runs get 0.0. Before issue 55 the pinned runs were the candidate's arm and
the rule promoted it. Now pinned runs and sibling runs are in no arm (the `rollout_runs` view,
migration 0016), one app key's runs are capped to `canary_max_key_share` of an arm (the rule), and
no agent is told which step served it (`X-Policy-Step`, unless `disclose_policy_step`).
"""

from __future__ import annotations

import httpx

from rlproxy.settings import RolloutSettings
from rlproxy.storage import keys as keystore
from rlproxy.storage import rollouts as store
from rlproxy.storage.models import TrainingStep
from rlproxy.storage.rollouts import ArmRun
from rlproxy.trainer.rollout_rule import cap_keys, decide

MSG = [{"role": "user", "content": "hi"}]
RULE = RolloutSettings(canary_min_runs=5, canary_looks=1, canary_min_pairs=50, canary_max_key_share=1.0)


def _key(proxy, name: str) -> dict[str, str]:
    _, secret = proxy.lt.run(keystore.create(proxy.state.engine, name))
    proxy.lt.run(proxy.state.keys.refresh())
    return {"Authorization": f"Bearer {secret}"}


def _run(proxy, auth, run_id: str, model: str, reward: float) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": f"task {run_id}"}]}
    answer = httpx.post(
        f"{proxy.url}/v1/chat/completions", json=body, headers={**auth, "X-Run-Id": run_id}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    got = httpx.post(f"{proxy.url}/v1/runs/{run_id}/reward", json={"reward": reward}, headers=auth)
    assert got.status_code == 200, got.text
    return answer


def _rollout(proxy) -> int:
    async def go() -> int:
        async with proxy.state.engine.begin() as conn:
            await conn.execute(TrainingStep.__table__.insert().values(policy="stub-model", step=1))
        rid, _ = await store.begin(proxy.state.engine, "stub-model", 1, 0.2)
        return rid

    return proxy.lt.run(go())


def test_pinned_runs_of_one_key_no_longer_promote_the_candidate(make_proxy, stub):
    proxy = make_proxy(stub.url, api_key="shared", admin_key="admin", disclose_policy_step=False)
    rid = _rollout(proxy)
    attacker, honest = _key(proxy, "attacker"), _key(proxy, "honest")
    for i in range(7):  # the candidate pinned, rewarded 1.0
        answer = _run(proxy, attacker, f"a{i}", "stub-model@1", 0.9 + 0.01 * i)
        assert "x-policy-step" not in answer.headers  # the serving step is not disclosed
    for i in range(10):  # the incumbent, served as routed, rewarded ~0
        _run(proxy, honest, f"h{i}", "stub-model", 0.01 * i)
    proxy.flush()
    cand, inc = proxy.lt.run(store.arm_runs(proxy.state.engine, rid))
    assert cand == [] and len(inc) == 10  # the pinned runs are in no arm
    verdict = decide(cand, inc, 0, RULE)
    assert verdict.decision == "continue", verdict  # was "promote" (p ~ 1e-14) before issue 55


def test_policy_step_is_disclosed_only_when_the_operator_says(make_proxy, stub):
    from rlproxy.settings import Settings

    assert Settings.model_fields["disclose_policy_step"].default is False  # (the suite turns it on)
    body = {"model": "stub-model", "messages": MSG}
    hidden = make_proxy(stub.url, disclose_policy_step=False)
    assert "x-policy-step" not in httpx.post(f"{hidden.url}/v1/chat/completions", json=body).headers
    shown = make_proxy(stub.url, disclose_policy_step=True)
    assert httpx.post(f"{shown.url}/v1/chat/completions", json=body).headers["x-policy-step"] == "0"


def test_one_key_is_capped_to_its_share_of_an_arm():
    """Unpinned runs of one key (it cannot pick its arm, but may flood one): at most half of the arm."""
    flood = [ArmRun(f"g{i}", 1.0, key_id="key_a") for i in range(40)]
    others = [ArmRun(f"g{i}", 0.2, key_id=f"key_{i % 3}") for i in range(6)]
    shared = [ArmRun("s", 0.3) for _ in range(4)]  # the shared agents' key: never capped
    kept = cap_keys(flood + others + shared, 0.5)
    mine = [r for r in kept if r.key_id == "key_a"]
    assert len(mine) == 10 and len(kept) == 20  # 10 of 20: no more than the others together
    assert all(r in kept for r in others + shared)
    assert cap_keys(flood, 1.0) == flood  # 1: no cap
    # the rule applies it before it counts: 30 runs of one key and 10 of another are 20 runs
    cand = [ArmRun(None, 1.0, key_id="key_a") for _ in range(30)] + [ArmRun(None, 0.5, key_id="key_b")] * 10
    inc = [ArmRun(None, 0.5, key_id="key_b") for _ in range(10)]
    capped = decide(
        cand, inc, 0, RolloutSettings(canary_min_runs=15, canary_looks=1, canary_max_key_share=0.5)
    )
    assert capped.stats["candidate_runs"] == 20, capped
