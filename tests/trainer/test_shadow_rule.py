"""The shadow check's parts (trainer/shadow.py): the decision rule with exact numbers, the sampling
parameters taken from a stored request, the prompts it picks, and a check with no verdict (too few
prompts, an engine or scorer that does not answer). End to end: test_shadow.py."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import insert

from rlproxy.storage import shadow as store
from rlproxy.storage.models import Completion
from rlproxy.trainer.scorers import ChecksScorer
from rlproxy.trainer.shadow import ShadowChecker, ShadowPending, _sampling, decide

# ---------------------------------------------------------------------- the decision rule


def test_decide_passes_within_the_margin_and_fails_beyond_it() -> None:
    # means 0.5 vs 0.55: a loss of exactly the margin passes (0.5 - 0.55 is -0.05000000000000004 in floats)
    v = decide([(0.5, 0.6), (0.5, 0.5)], 0.05)
    assert (v.passed, v.candidate, v.serving) == (True, 0.5, 0.55)
    assert v.reason == "candidate 0.500 vs serving 0.550 on 2 prompts: -0.050 >= -0.05 (margin)"
    v = decide([(0.5, 0.6), (0.5, 0.52)], 0.05)  # loses by 0.06
    assert (v.passed, v.candidate, v.serving) == (False, 0.5, 0.56)
    assert v.reason == "candidate 0.500 vs serving 0.560 on 2 prompts: -0.060 < -0.05 (margin)"
    assert decide([(0.0, 1.0), (1.0, 0.0), (0.25, 0.25)], 0.0).passed  # a tie passes at margin 0
    assert not decide([(0.0, 0.0), (0.0, 1.0)], 0.4).passed  # 0 vs 0.5
    assert decide([(1.0, 0.0)] * 3, 0.0).candidate == 1.0  # winning is always a pass
    with pytest.raises(ValueError):
        decide([], 0.05)


def test_sampling_takes_the_stored_requests_parameters() -> None:
    assert _sampling({"max_tokens": 7, "temperature": 0.3, "top_p": 0.9, "stop": "x"}) == {
        "max_tokens": 7,
        "temperature": 0.3,
        "top_p": 0.9,
        "stop": ["x"],
    }
    assert _sampling({"max_completion_tokens": 9, "temperature": None, "stop": ["a", 3]}) == {
        "max_tokens": 9,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": ["a"],
    }
    assert _sampling({})["max_tokens"] == 256


# ---------------------------------------------------------------------- which prompts


async def _untagged(engine: Any, ids: list[int], policy: str = "tiny", **kw: Any) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            insert(Completion).values(
                **{
                    "run_id": None,
                    "policy": policy,
                    "status": "ok",
                    "prompt_token_ids": ids,
                    "request": {"max_tokens": 4},
                    "endpoint": "chat.completions",
                    **kw,
                }
            )
        )


async def test_prompts_are_recent_untrained_distinct_and_not_siblings(engine: Any, add_run: Any) -> None:
    one = [{"prompt_token_ids": [1, 2, 3], "token_ids": [[4]], "logprobs": [[-0.1]]}]
    await add_run(engine, "trained", status="trained", completions=one)
    await add_run(engine, "in-step", completions=[{**one[0], "prompt_token_ids": [7, 7]}])
    await add_run(
        engine, "open", status="open", reward=None, completions=[{**one[0], "prompt_token_ids": [8]}]
    )
    await add_run(engine, "sib", completions=[{**one[0], "prompt_token_ids": [9]}])
    async with engine.begin() as conn:
        await conn.exec_driver_sql("UPDATE runs SET branch_of = 1 WHERE id = 'sib'")
    await _untagged(engine, [10, 11])
    await _untagged(engine, [12], source="hosted")  # a hosted answer: no exact ids to trust
    await _untagged(engine, [13], status="error")
    await _untagged(engine, [14], policy="other")
    await _untagged(engine, [10, 11])  # the same prompt again: once
    await _untagged(engine, [15])
    got = await store.recent_prompts(engine, "tiny", 10, exclude_runs=["in-step"])
    assert [p.prompt_ids for p in got] == [[15], [10, 11], [8]]  # newest first
    assert got[1].completion_id > got[2].completion_id
    assert [p.prompt_ids for p in await store.recent_prompts(engine, "tiny", 2)] == [[15], [10, 11]]
    assert [7, 7] in [p.prompt_ids for p in await store.recent_prompts(engine, "tiny", 10)]


# ---------------------------------------------------------------------- no verdict


def _checker(url: str = "http://127.0.0.1:9", **kw: Any) -> ShadowChecker:
    return ShadowChecker(
        prompts=8,
        margin=0.05,
        make_scorer=lambda client: ChecksScorer(),
        resolve=lambda: (url, "tiny", None),
        **kw,
    )


async def test_too_few_prompts_skip_the_check_and_the_step_goes_live(engine: Any) -> None:
    await _untagged(engine, [1, 2])  # one prompt: nothing to compare on
    outcome = await _checker().check(engine, "tiny", 1, [])
    assert (outcome.status, outcome.serves, outcome.serving_step) == ("skipped", True, 0)
    row = await store.get_check(engine, "tiny", 1)
    assert row is not None and (row["status"], row["prompts"]) == ("skipped", 1)
    assert row["reason"].startswith("skipped: 1 stored prompt(s) of tiny not trained on (2 needed)")


async def test_a_check_without_a_verdict_waits_then_stops_the_step(engine: Any) -> None:
    await _untagged(engine, [1, 2])
    await _untagged(engine, [3, 4])
    checker = _checker(max_attempts=3, retry_after=0.0)  # port 9: the engine does not answer
    for attempt in (1, 2):
        with pytest.raises(ShadowPending, match=f"attempt {attempt} of 3"):
            await checker.check(engine, "tiny", 1, [])
        assert checker.waiting("tiny") and not checker.waiting("other")
        row = await store.get_check(engine, "tiny", 1)
        assert row is not None and row["status"] == "error"
    outcome = await checker.check(engine, "tiny", 1, [])
    assert (outcome.status, outcome.serves) == ("error", False)
    assert outcome.reason.startswith("no verdict after 3 attempt(s): the engine did not answer")
    assert not checker.waiting("tiny")
    await checker.close()


async def test_retries_wait_retry_after(engine: Any) -> None:
    await _untagged(engine, [1, 2])
    await _untagged(engine, [3, 4])
    checker = _checker(max_attempts=3, retry_after=60.0)
    with pytest.raises(ShadowPending, match="attempt 1 of 3"):
        await checker.check(engine, "tiny", 1, [])
    with pytest.raises(ShadowPending, match="tried again in"):  # too soon: not an attempt
        await checker.check(engine, "tiny", 1, [])
    assert checker._failures[("tiny", 1)][0] == 1
    await checker.close()


async def test_a_step_committed_elsewhere_stops_the_wait(engine: Any) -> None:
    await _untagged(engine, [1, 2])
    await _untagged(engine, [3, 4])
    checker = _checker(max_attempts=3, retry_after=60.0)
    with pytest.raises(ShadowPending):
        await checker.check(engine, "tiny", 1, [])
    checker.settled("tiny", 1)  # still the newest uncommitted checkpoint: still waiting
    assert checker.waiting("tiny") and checker.retry_in("tiny", 1) > 0
    checker.settled("tiny", None)  # step 1 was committed by another process, or discarded
    assert not checker.waiting("tiny") and checker.retry_in("tiny", 1) == 0
    await checker.close()
