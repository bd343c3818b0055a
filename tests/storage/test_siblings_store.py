"""Siblings' storage on SQLite and PostgreSQL: which calls branch, a group written in one transaction
(idempotent), its members read by the trainer like one-call runs, scores, and a scorer that fails."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine
from storage.test_writer import rec, rows

from rlproxy.storage import siblings
from rlproxy.storage.errors import RunNotFound
from rlproxy.storage.judging import judge_groups
from rlproxy.storage.models import Run, RunStatus
from rlproxy.storage.records import CompletionRecord
from rlproxy.storage.training import StatusReason, load_runs, mark_runs, ready_groups, ungroup_runs
from rlproxy.storage.writer import Writer

PROMPT = [5, 6, 7, 8]


def call(run_id: str | None, i: int, **kw: Any) -> CompletionRecord:
    group = kw.pop("default_group", "g-default")
    return dataclasses.replace(rec(run_id, i, prompt_token_ids=PROMPT, default_group=group), **kw)


async def _store(engine: AsyncEngine, *records: CompletionRecord) -> None:
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    for r in records:
        w.submit(r)
    await w.close()


def _members(n: int) -> list[siblings.Member]:
    return [siblings.Member([10 + i, 11], [-0.5, -0.25], f"s{i}", "stop") for i in range(n)]


async def _group(engine: AsyncEngine, c: siblings.BranchCall, gid: str, *, original: bool = True) -> bool:
    body = siblings.sampled_request("p@1", c.prompt_ids, max_tokens=8, temperature=0.9, top_p=1.0, stop=None)
    return await siblings.create_group(
        engine,
        group_id=gid,
        call=c,
        model="p@1",
        policy_step=1,
        members=_members(2),
        request=body,
        with_original=original,
        temperature=0.9,
        sampled_tokens=4,
        sample_ms=12.0,
    )


async def test_new_calls_skip_hosted_val_and_sibling_runs(engine: AsyncEngine) -> None:
    await _store(
        engine,
        call("a", 0),
        call("h", 1, source="hosted"),  # a hosted answer: never branched
        call("v", 2, split="val"),  # a validation run: never trained, never branched
        call(None, 3),  # untagged: branched (its group has no app run)
        rec("t", 4),  # no prompt ids: nothing to sample from
        call("e", 5, status="error"),
    )
    got, cursor = await siblings.new_calls(engine, after=0)
    assert [(c.run_id, c.reason) for c in got] == [("a", "new"), (None, "new")]
    assert got[0].prompt_ids == PROMPT and got[0].token_ids == [1, 2, 3]
    assert got[0].request["messages"][0]["content"] == "q0"
    assert cursor == max(r[0] for r in await rows(engine, "SELECT id FROM completions"))
    assert await siblings.new_calls(engine, after=cursor) == ([], cursor)
    # a branched call is not offered again, nor are the members' own completions
    assert await _group(engine, got[0], "sg-a")
    again, _ = await siblings.new_calls(engine, after=0)
    assert [c.run_id for c in again] == [None]


async def test_group_is_written_once_and_trains_like_one_call_runs(engine: AsyncEngine) -> None:
    await _store(engine, call("a", 0))
    (c,), _ = await siblings.new_calls(engine, after=0)
    assert await _group(engine, c, "sg-1") is True
    assert await _group(engine, c, "sg-other") is False  # UNIQUE (completion_id): once
    got = await rows(engine, "SELECT id, status, k, with_original, reason FROM sibling_groups")
    assert [(g[0], g[1], g[2], bool(g[3]), g[4]) for g in got] == [("sg-1", "scoring", 3, True, "new")]
    members = await rows(
        engine,
        "SELECT id, group_id, policy, status, branch_of, split, reward FROM runs WHERE branch_of IS NOT NULL "
        "ORDER BY id",
    )
    assert [m[0] for m in members] == ["sg-1:0", "sg-1:1", "sg-1:2"]
    assert {m[1:] for m in members} == {("sg-1", "p", "open", c.completion_id, "train", None)}
    # the app's run is untouched; not ready before it is scored
    assert await rows(engine, "SELECT status, reward FROM runs WHERE id = 'a'") == [("open", None)]
    assert await ready_groups(engine, group_size=8, group_timeout=600) == []

    assert (await siblings.scoring_groups(engine))[0].members[0].original is True
    n = await siblings.store_scores(engine, "sg-1", {"sg-1:0": 1.0, "sg-1:1": 0.0, "sg-1:2": 0.5}, "checks")
    assert n == 3
    assert await siblings.scoring_groups(engine) == []
    # an app cannot reward a member: it is the proxy's run, as unknown to the app as an unused id
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    for member in ("sg-1:0", "sg-1:1"):
        with pytest.raises(RunNotFound):
            await w.reward(member, 0.25)
    await w.close()
    assert await rows(engine, "SELECT reward FROM runs WHERE id = 'sg-1:1'") == [(0.0,)]
    # ready at once, whatever group_size: all its members are in
    (g,) = await ready_groups(engine, group_size=8, group_timeout=600)
    assert g.group_id == "sg-1" and g.sources == ["sibling"] * 3 and sorted(g.rewards) == [0.0, 0.5, 1.0]
    runs = {r.run_id: r for r in await load_runs(engine, g.run_ids)}
    assert all(r.sibling and len(r.completions) == 1 for r in runs.values())
    orig, sib = runs["sg-1:0"].completions[0], runs["sg-1:1"].completions[0]
    assert (
        orig.prompt_token_ids == PROMPT
        and orig.token_ids == [[1, 2, 3]]
        and orig.endpoint == "chat.completions"
    )
    assert sib.prompt_token_ids == PROMPT and sib.token_ids == [[10, 11]] and sib.logprobs == [[-0.5, -0.25]]
    assert sib.endpoint == "completions" and sib.request["temperature"] == 0.9 and sib.policy_step == 1
    assert sib.response["choices"][0]["finish_reason"] == "stop"
    # never judged again, even under judge=always (its scorer gave its rewards)
    assert await judge_groups(engine, group_size=2, group_timeout=0, mode_of=lambda p: "always") == []
    # never ungrouped, and never counted as an app's canary run
    assert await ungroup_runs(engine, group_timeout=0) == 0
    assert await rows(engine, "SELECT count(*) FROM rollout_runs") == [(0,)]


async def test_zero_variance_sibling_group_is_skipped_like_any(engine: AsyncEngine) -> None:
    await _store(engine, call("a", 0))
    (c,), _ = await siblings.new_calls(engine, after=0)
    await _group(engine, c, "sg-z", original=False)
    await siblings.store_scores(engine, "sg-z", {"sg-z:0": 1.0, "sg-z:1": 1.0}, "checks")
    (g,) = await ready_groups(engine, group_size=8, group_timeout=600)
    assert g.zero_variance


async def test_scorer_failures_are_counted_then_fail_the_group(engine: AsyncEngine) -> None:
    await _store(engine, call("a", 0))
    (c,), _ = await siblings.new_calls(engine, after=0)
    await _group(engine, c, "sg-f")
    assert await siblings.fail_scoring(engine, "sg-f", "scorer answered 500", max_attempts=2) is False
    (g,) = await siblings.scoring_groups(engine)
    assert g.attempts == 1
    assert await siblings.fail_scoring(engine, "sg-f", "timed out", max_attempts=2) is True
    assert await rows(engine, "SELECT status, attempts, error FROM sibling_groups") == [
        ("failed", 2, "timed out")
    ]
    got = await rows(engine, "SELECT DISTINCT status, status_reason FROM runs WHERE group_id = 'sg-f'")
    assert got == [("failed", StatusReason.scorer_failed.value)]
    assert await siblings.store_scores(engine, "sg-f", {"sg-f:0": 1.0}, "checks") == 0  # too late


async def test_alone_and_plateau_calls(engine: AsyncEngine) -> None:
    recs = [call("lone", 0), call("lone", 1), call("lone", 2)]
    recs += [call(f"flat{i}", 3 + i, default_group="gz") for i in range(3)]
    await _store(engine, *recs)
    w = Writer(engine, flush_interval=0.01)
    await w.start()
    for rid in ("lone", "flat0", "flat1", "flat2"):
        await w.reward(rid, 0.5)
    await w.close()
    async with engine.begin() as conn:
        await conn.execute(
            update(Run)
            .where(Run.id == "lone")
            .values(status=RunStatus.ungrouped, status_reason=StatusReason.no_sibling)
        )
    await mark_runs(engine, ["flat0", "flat1", "flat2"], RunStatus.skipped, StatusReason.zero_variance)
    since = datetime.now(UTC) - timedelta(hours=1)
    alone = await siblings.alone_calls(engine, since=since, calls_per_run=2)
    assert [(c.run_id, c.reason) for c in alone] == [("lone", "alone"), ("lone", "alone")]
    flat = await siblings.plateau_calls(engine, since=since, calls_per_run=2)
    assert [(c.run_id, c.reason) for c in flat] == [("flat0", "plateau")]  # one run per skipped group
    later = datetime.now(UTC) + timedelta(hours=1)
    assert await siblings.alone_calls(engine, since=later, calls_per_run=2) == []
