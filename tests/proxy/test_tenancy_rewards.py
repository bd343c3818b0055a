"""Issue 22 case 3: bounded rewards, and a non-finite step fails only the groups that caused it.

The reward route through a real proxy under uvicorn (`make_proxy`, what `rlproxy serve` builds) on a
stub upstream, raw bodies sent with httpx; the culprit rule of the trainer (trainer/culprits.py) on
the trainer's own data classes.

Before issue 22: two rewards near 1e308 were accepted (a step's advantages became NaN, and after
three skipped steps every run of the step failed, another tenant's group included), and a 401-digit
integer reward was a 500.
"""

from __future__ import annotations

import httpx
import pytest

from rlproxy.storage.training import CompletionData, RunData
from rlproxy.trainer.culprits import nonfinite_groups


def _reward(base: str, run_id: str, raw: str) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/runs/{run_id}/reward", content=raw, headers={"content-type": "application/json"}
    )


@pytest.mark.parametrize(
    "raw",
    [
        '{"reward": 1' + "0" * 400 + "}",  # a 401-digit integer: beyond any float
        '{"reward": -1' + "0" * 400 + "}",
        '{"reward": 1e308}',  # finite, but beyond reward_bound
        '{"reward": 0.5, "metrics": {"m": 1' + "0" * 400 + "}}",
        '{"reward": 1e400}',
        '{"reward": NaN}',
    ],
    ids=["int401", "neg_int401", "1e308", "metric_int401", "1e400", "nan"],
)
def test_case3_out_of_range_reward_is_422(make_proxy, stub, raw):
    proxy = make_proxy(stub.url)
    httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Run-Id": "r-1"},
    )
    resp = _reward(proxy.url, "r-1", raw)
    assert resp.status_code == 422, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] in ("reward", "metrics.m")
    assert proxy.query("SELECT status, reward FROM runs") == [("open", None)]


def test_case3_reward_bound_is_a_setting(make_proxy, stub):
    proxy = make_proxy(stub.url, reward_bound=10.0)
    for run in ("a", "b"):
        httpx.post(
            f"{proxy.url}/v1/chat/completions",
            json={"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Run-Id": run},
        )
    assert _reward(proxy.url, "a", '{"reward": 10.5}').status_code == 422
    assert "reward_bound" in _reward(proxy.url, "a", '{"reward": -11}').json()["error"]["message"]
    assert _reward(proxy.url, "b", '{"reward": -10}').status_code == 200


def _run(run_id: str, group: str, reward: float, logprob: float = -0.5) -> RunData:
    comp = CompletionData(
        run_id=run_id,
        seq=0,
        policy_step=0,
        endpoint="chat.completions",
        request=None,
        response=None,
        prompt_token_ids=[1, 2],
        token_ids=[[3, 4]],
        logprobs=[[-0.1, logprob]],
    )
    return RunData(run_id, group, "p", reward, completions=[comp])


def test_case3_nonfinite_step_fails_only_the_groups_that_caused_it():
    runs = [
        _run("huge-0", "tenant-a", 1.7e308),  # stored before the bound existed
        _run("huge-1", "tenant-a", -1.7e308),
        _run("ok-0", "tenant-b", 0.9),
        _run("ok-1", "tenant-b", 0.1),
        _run("inf-lp", "tenant-c", 0.9, logprob=float("-inf")),  # an importance ratio of inf
        _run("ok-2", "tenant-c", 0.2),
    ]
    assert nonfinite_groups(runs) == {"huge-0", "huge-1", "inf-lp", "ok-2"}
    assert nonfinite_groups(runs[2:4]) == set()  # no visible cause: the service fails the whole step
