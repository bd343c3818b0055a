"""The judge's storage on SQLite and PostgreSQL: completing runs for the judge through the writer, the
groups that wait for it, storing its scores, and failing a group."""

from __future__ import annotations

import json

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from storage.test_writer import rec, rows

from rlproxy.storage.errors import RewardConflict, RubricConflict
from rlproxy.storage.judging import judge_groups, store_scores
from rlproxy.storage.models import RunStatus
from rlproxy.storage.training import StatusReason, mark_runs, ready_groups
from rlproxy.storage.writer import Writer


async def test_judged_runs_wait_then_take_the_judges_scores(engine: AsyncEngine) -> None:
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    for i, run_id in enumerate(["j1", "j2", "j3", "app"]):
        w.submit(rec(run_id, i, default_group="g"))
    assert await w.reward("j1", None, rubric="short is good") is True  # completed for the judge
    assert await w.reward("j1", None, rubric="short is good") is False  # the same again
    # issue 22 case 1: one rubric per group; a conflicting one (or none against one) is a 409
    with pytest.raises(RubricConflict):
        await w.reward("j3", None, rubric="long is good")
    with pytest.raises(RubricConflict):
        await w.reward("j3", None)
    assert await w.reward("j2", None, metadata={"k": 1}, rubric="short is good") is True
    with pytest.raises(RewardConflict):  # a number for a run waiting for the judge
        await w.reward("j2", 1.0)
    assert await w.reward("app", 0.5) is True
    with pytest.raises(RewardConflict):  # the judge for a run with an app reward
        await w.reward("app", None)
    await w.close()

    # not trainable yet (no reward), and not judged before the group is ready; the judge (missing)
    # sees only the runs that asked for it, never the app-rewarded one (issue 22 case 1)
    assert await ready_groups(engine, group_size=2, group_timeout=600) == []
    assert await judge_groups(engine, group_size=3, group_timeout=600) == []
    (group,) = await judge_groups(engine, group_size=2, group_timeout=600)
    assert sorted(group.run_ids) == ["j1", "j2"]
    shown = {r.run_id: (r.rubric, r.messages) for r in group.runs}
    assert shown["j1"][0] == "short is good" and shown["j2"][0] == "short is good"
    assert [m["role"] for m in shown["j1"][1]] == ["user", "assistant"]
    # judge=always (the operator's choice) shows the app-rewarded run too
    (everyone,) = await judge_groups(engine, group_size=3, group_timeout=600, mode_of=lambda p: "always")
    assert sorted(everyone.run_ids) == ["app", "j1", "j2"]
    # a policy whose judge is off still shows its waiting runs (the judge service fails them: judge_off)
    assert await judge_groups(engine, group_size=2, group_timeout=600, mode_of=lambda p: "off") != []

    # a score for the app-rewarded run is never stored over its app reward (judge=missing)
    n = await store_scores(engine, {"j1": (1.0, "best"), "j2": (0.0, "worst"), "app": (0.9, "forged")})
    assert n == 2
    got = await rows(
        engine,
        "SELECT id, reward, reward_source, judge_explanation, judge_rubric, metrics FROM runs ORDER BY id",
    )
    metrics = {r[0]: (json.loads(r[5]) if isinstance(r[5], str) else r[5]) for r in got}
    assert [r[:5] for r in got] == [
        ("app", 0.5, "app", None, None),
        ("j1", 1.0, "judge", "best", "short is good"),
        ("j2", 0.0, "judge", "worst", "short is good"),
        ("j3", None, None, None, None),
    ]
    assert metrics["app"] is None and metrics["j1"] is None
    assert await judge_groups(engine, group_size=2, group_timeout=600) == []  # nothing waits now
    # app rewards and judge scores never share a baseline: the judged pair is its own ready group
    (ready,) = await ready_groups(engine, group_size=2, group_timeout=600)
    assert sorted(ready.run_ids) == ["j1", "j2"] and ready.sources == ["judge", "judge"]


async def test_a_failed_judgement_is_visible(engine: AsyncEngine) -> None:
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    for i, run_id in enumerate(["f1", "f2"]):
        w.submit(rec(run_id, i, default_group="g"))
        assert await w.reward(run_id, None) is True
    await w.close()
    (group,) = await judge_groups(engine, group_size=2, group_timeout=600)
    assert await mark_runs(engine, group.run_ids, RunStatus.failed, StatusReason.judge_failed) == 2
    assert await rows(engine, "SELECT DISTINCT status, status_reason, reward FROM runs") == [
        ("failed", "judge_failed", None)
    ]
    assert await judge_groups(engine, group_size=2, group_timeout=0.0) == []
    assert await store_scores(engine, {"f1": (1.0, "late")}) == 0  # scores for failed runs change nothing


async def test_a_judges_explanation_holding_nul_is_stored(engine: AsyncEngine) -> None:
    """Issue 55: the judge is a model too; U+0000 in its explanation failed the transaction on
    PostgreSQL (text cannot hold it), so the group's scores were never stored."""
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    w.submit(rec("n1", 0, default_group="g"))
    assert await w.reward("n1", None) is True
    await w.close()
    assert await store_scores(engine, {"n1": (1.0, "good\x00answer")}) == 1
    ((reward, explanation),) = await rows(
        engine, "SELECT reward, judge_explanation FROM runs WHERE id = 'n1'"
    )
    assert reward == 1.0 and explanation in ("good\x00answer", "good\ufffdanswer")
