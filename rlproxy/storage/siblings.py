"""Siblings' queries: which stored calls to branch, writing a sibling group, and storing its scores.

A sibling group (docs/siblings.md) is K answers to one stored prompt from one policy step: the
app's own answer (when its step was still loaded: `with_original`) and the proxy's samples. Its
members are ordinary `runs` rows (`group_id` = `sibling_groups.id`, `branch_of` = the call's
`completions.id`, split `train`; ids `sib-<id>:<i>`, a keyed call's in its key's namespace:
`<key id>~sib-<id>:<i>`), each with ONE completion that a trainer reads like a one-call run:
the exact prompt ids, the sampled ids and logprobs, and the request body that sampled them (a
`/v1/completions` body holding its temperature/top_p/max_tokens, so `batches.sampling_temperature`
reads it like any call's). The app's answer is a copy of its completion (its own request, response
and endpoint) in a member run of its own; the app's run is never touched.

Which calls (`settings.siblings` modes; every read skips hosted calls, sibling runs, validation runs
and calls already branched, and needs stored prompt and sampled ids of one choice):

    new       calls stored after a cursor (`completions.id`): read once each, in id order
    alone     the first `siblings_calls_per_run` calls of runs `ungrouped` (`no_sibling`)
    plateau   the first `siblings_calls_per_run` calls of ONE run (the oldest) per group `skipped`
              for `zero_variance`: its runs started from the same prompt, so branching each run's
              first call would sample the same prompt again and again; one run's calls are where
              the group's answers first could differ
    imported  calls `rlproxy import` stored (`source` 'import': text only, so these alone are read
              WITHOUT ids; the service renders their prompt ids), after a cursor, in id order
    (alone and plateau read runs rewarded since `since`: a window, so the reads stay bounded)

Life of a group: `create_group` writes the row (status `scoring`: every member is stored at once)
and its members (`open`, reward NULL) in ONE transaction, idempotent on UNIQUE (completion_id);
`store_scores` gives each member its score (`reward_source` 'sibling', `completed`) and the group
`scored`; `fail_scoring` counts an attempt and at `max_attempts` fails the group and its runs
(`scorer_failed`). A scored group is ready for the trainer at once (training.ready_groups).

(Over 400 lines: the reads that choose calls and the writes of a group's life are one contract over
the same rows and statuses.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, exists, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.db import write_transaction
from rlproxy.storage.models import Completion, Key, Run, RunStatus, SiblingGroup, SiblingStatus
from rlproxy.storage.training import StatusReason

log = logging.getLogger(__name__)

REWARD_SOURCE = "sibling"  # runs.reward_source of a scored member
SAMPLED_ENDPOINT = "completions"  # a sampled member's completion: the /v1/completions call that made it
IMPORTED = "import"  # completions.source of a call `rlproxy import` stored (traces/readers)


@dataclass
class BranchCall:
    """A stored call chosen for siblings: what sampling and scoring need of it."""

    completion_id: int
    run_id: str | None
    policy: str
    adapter: str | None  # the model that served it: policy@step, or the base
    policy_step: int | None
    endpoint: str | None
    request: dict[str, Any]
    response: dict[str, Any] | None
    prompt_ids: list[int]
    token_ids: list[int]  # the app's sampled ids (choice 0)
    logprobs: list[float] | None
    finish_reason: str | None
    reason: str = "new"  # new, alone, plateau or imported (text only: prompt_ids filled in when sampled)
    key_id: str | None = None  # the app key that made the call: its siblings are that key's too


@dataclass
class Member:
    """One sampled answer of a group."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


@dataclass
class ScoringMember:
    """A stored member of a group waiting for its scorer, in member order."""

    run_id: str
    original: bool  # the app's own answer
    endpoint: str | None
    response: dict[str, Any] | None


@dataclass
class ScoringGroup:
    """A group in `scoring`: the app's stored request and its members."""

    group_id: str
    policy: str
    attempts: int
    endpoint: str | None  # the branched call's
    request: dict[str, Any]
    members: list[ScoringMember] = field(default_factory=list)
    scorer_url: str | None = None  # the call's app key's own scorer (keys.scorer_url), if it has one


def _one_choice(row: Any) -> bool:
    """The call has a flat prompt of ids and exactly one sampled choice (what a group branches)."""
    p, t = row.prompt_token_ids, row.token_ids
    prompt = isinstance(p, list) and bool(p) and all(isinstance(x, int) for x in p)
    return prompt and isinstance(t, list) and len(t) == 1 and isinstance(t[0], list) and bool(t[0])


def _call(row: Any, reason: str) -> BranchCall:
    lps = row.logprobs[0] if isinstance(row.logprobs, list) and row.logprobs else None
    same = ("run_id", "policy", "adapter", "policy_step", "endpoint", "response", "finish_reason", "key_id")
    return BranchCall(
        completion_id=row.id,
        request=row.request or {},
        prompt_ids=list(row.prompt_token_ids or []),
        token_ids=list(row.token_ids[0]) if row.token_ids else [],
        logprobs=list(lps) if isinstance(lps, list) else None,
        reason=reason,
        **{name: getattr(row, name) for name in same},
    )


_COLUMNS = (
    Completion.id,
    Completion.run_id,
    Completion.policy,
    Completion.adapter,
    Completion.policy_step,
    Completion.endpoint,
    Completion.request,
    Completion.response,
    Completion.prompt_token_ids,
    Completion.token_ids,
    Completion.logprobs,
    Completion.finish_reason,
    Completion.key_id,
)


def _branchable() -> tuple[Any, ...]:
    """The conditions every branched call meets (module doc)."""
    return (
        Completion.status == "ok",
        Completion.source.is_(None),  # never a hosted (text-only) answer
        Completion.policy.is_not(None),
        Completion.prompt_token_ids.is_not(None),
        Completion.token_ids.is_not(None),
        ~exists().where(SiblingGroup.completion_id == Completion.id),
    )


async def new_calls(engine: AsyncEngine, *, after: int, limit: int = 200) -> tuple[list[BranchCall], int]:
    """Calls stored after completion id `after` that may be branched, and the cursor to read on from
    (the last id read, branchable or not). Untagged calls count; sibling and validation runs do not."""
    q = (
        select(*_COLUMNS)
        .outerjoin(Run, Run.id == Completion.run_id)
        .where(Completion.id > after)
        .where(or_(Completion.run_id.is_(None), and_(Run.branch_of.is_(None), Run.split == "train")))
        .order_by(Completion.id)
        .limit(limit)
    )
    cursor_q = select(Completion.id).where(Completion.id > after).order_by(Completion.id).limit(limit)
    async with engine.connect() as conn:
        ids = (await conn.execute(cursor_q)).scalars().all()
        if not ids:
            return [], after
        rows = (await conn.execute(q.where(Completion.id <= ids[-1], *_branchable()))).all()
    return [_call(r, "new") for r in rows if _one_choice(r)], int(ids[-1])


async def imported_calls(
    engine: AsyncEngine, *, after: int, limit: int = 200
) -> tuple[list[BranchCall], int]:
    """Imported chat calls (`source` 'import', train runs, not branched) after completion id `after`,
    at most `limit`, and the cursor to read on from: the last one read, or, once none is left, the
    newest stored id (a later import's calls come after it)."""
    q = (
        select(*_COLUMNS)
        .join(Run, Run.id == Completion.run_id)
        .where(Completion.id > after, Completion.source == IMPORTED, Completion.status == "ok")
        .where(Completion.policy.is_not(None), Completion.request.is_not(None))
        .where(Run.branch_of.is_(None), Run.split == "train")
        .where(~exists().where(SiblingGroup.completion_id == Completion.id))
        .order_by(Completion.id)
        .limit(limit)
    )
    async with engine.connect() as conn:
        newest = int(await conn.scalar(select(func.max(Completion.id))) or 0)
        rows = (await conn.execute(q.where(Completion.id <= newest))).all()
    cursor = rows[-1].id if len(rows) == limit else max(after, newest)
    chats = [r for r in rows if isinstance((r.request or {}).get("messages"), list)]
    return [_call(r, "imported") for r in chats], int(cursor)


async def last_completion_id(engine: AsyncEngine) -> int:
    """The newest stored call's id (0: none): where `new_calls` starts reading."""
    async with engine.connect() as conn:
        return int(await conn.scalar(select(func.max(Completion.id))) or 0)


async def alone_calls(
    engine: AsyncEngine, *, since: datetime, calls_per_run: int, limit: int = 200
) -> list[BranchCall]:
    """The first `calls_per_run` calls of runs `ungrouped` (no_sibling) rewarded since `since`."""
    q = (
        select(*_COLUMNS)
        .join(Run, Run.id == Completion.run_id)
        .where(Run.status == RunStatus.ungrouped, Run.status_reason == StatusReason.no_sibling)
        .where(Run.completed_at >= since, Run.branch_of.is_(None), Run.split == "train")
        .where(Completion.seq < calls_per_run, *_branchable())
        .order_by(Run.completed_at, Run.id, Completion.seq)
        .limit(limit)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(q)).all()
    return [_call(r, "alone") for r in rows if _one_choice(r)]


async def plateau_calls(
    engine: AsyncEngine, *, since: datetime, calls_per_run: int, limit: int = 200
) -> list[BranchCall]:
    """The first `calls_per_run` calls of the oldest run of each group skipped for zero variance
    (rewarded since `since`)."""
    skipped = (
        select(Run.id, Run.policy, Run.group_id)
        .where(Run.status == RunStatus.skipped, Run.status_reason == StatusReason.zero_variance)
        .where(Run.completed_at >= since, Run.branch_of.is_(None), Run.split == "train")
        .order_by(Run.created_at, Run.id)
    )
    async with engine.connect() as conn:
        first: dict[tuple[str | None, str | None], str] = {}
        for r in (await conn.execute(skipped)).all():
            first.setdefault((r.policy, r.group_id), r.id)
        if not first:
            return []
        rows = (
            await conn.execute(
                select(*_COLUMNS)
                .where(Completion.run_id.in_(list(first.values())), Completion.seq < calls_per_run)
                .where(*_branchable())
                .order_by(Completion.id)
                .limit(limit)
            )
        ).all()
    return [_call(r, "plateau") for r in rows if _one_choice(r)]


def sampled_request(
    model: str,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    stop: list[str] | None,
) -> dict[str, Any]:
    """The stored request of a sampled member: the `/v1/completions` body that sampled it (n = 1)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "logprobs": 0,
    }
    if stop:
        body["stop"] = stop
    return body


async def create_group(
    engine: AsyncEngine,
    *,
    group_id: str,
    call: BranchCall,
    model: str,
    policy_step: int | None,
    members: list[Member],
    request: dict[str, Any],
    with_original: bool,
    temperature: float | None,
    sampled_tokens: int,
    sample_ms: float,
) -> bool:
    """Write the group (status `scoring`) and its member runs, each with its one completion, in ONE
    transaction; False (nothing written) when the call is already branched.

    `request` is the stored request of every sampled member (`sampled_request`); `model` the adapter
    that sampled them. With `with_original` the app's completion is copied as member 0.
    """
    now = datetime.now(UTC)
    k = len(members) + (1 if with_original else 0)
    runs: list[dict[str, Any]] = []
    comps: list[dict[str, Any]] = []

    def add(i: int, original: bool, completion: dict[str, Any]) -> None:
        rid = f"{group_id}:{i}" if call.key_id is None else f"{call.key_id}~{group_id}:{i}"  # the key's ids
        runs.append(
            {
                "id": rid,
                "group_id": group_id,
                "policy": call.policy,
                "status": RunStatus.open,
                "split": "train",
                "branch_of": call.completion_id,
                "key_id": call.key_id,
                "created_at": now,
                "next_seq": 1,
                "metadata": {"sibling_member": i, "original": original},
            }
        )
        comps.append({"run_id": rid, "seq": 0, "policy": call.policy, "status": "ok", "created_at": now,
                      "key_id": call.key_id,
                      "status_code": 200, "stream": False, "prompt_token_ids": call.prompt_ids,
                      "prompt_tokens": len(call.prompt_ids), **completion})  # fmt: skip

    if with_original:
        add(
            0,
            True,
            {
                "adapter": call.adapter,
                "policy_step": call.policy_step,
                "endpoint": call.endpoint,
                "request": call.request,
                "response": call.response,
                "token_ids": [call.token_ids],
                "logprobs": [call.logprobs] if call.logprobs is not None else None,
                "finish_reason": call.finish_reason,
                "completion_tokens": len(call.token_ids),
            },
        )
    for m in members:
        add(
            len(runs),
            False,
            {
                "adapter": model,
                "policy_step": policy_step,
                "endpoint": SAMPLED_ENDPOINT,
                "request": request,
                "response": {
                    "object": "text_completion",
                    "model": model,
                    "choices": [{"index": 0, "text": m.text, "finish_reason": m.finish_reason}],
                },
                "token_ids": [m.token_ids],
                "logprobs": [m.logprobs],
                "finish_reason": m.finish_reason,
                "completion_tokens": len(m.token_ids),
            },
        )
    group = dict(id=group_id, completion_id=call.completion_id, run_id=call.run_id, policy=call.policy,
                 policy_step=policy_step, k=k, with_original=with_original, reason=call.reason,
                 temperature=temperature, status=SiblingStatus.scoring, attempts=0,
                 sampled_tokens=sampled_tokens, sample_ms=sample_ms, created_at=now)  # fmt: skip
    return await _insert_group(engine, group, runs, comps)


async def _insert_group(
    engine: AsyncEngine,
    group: dict[str, Any],
    runs: list[dict[str, Any]] | None = None,
    comps: list[dict[str, Any]] | None = None,
) -> bool:
    """Insert a sibling group row (with its member runs and completions) in ONE transaction; False,
    nothing written, when its call is branched already (or by another writer meanwhile)."""
    try:
        async with write_transaction(engine) as conn:
            taken = await conn.scalar(
                select(SiblingGroup.id).where(SiblingGroup.completion_id == group["completion_id"])
            )
            if taken is not None:
                return False
            await conn.execute(insert(SiblingGroup).values(**group))
            if runs:
                await conn.execute(insert(Run), runs)
                await conn.execute(insert(Completion), comps)
    except IntegrityError:  # another writer branched the same call meanwhile
        return False
    return True


async def fail_sampling(engine: AsyncEngine, *, group_id: str, call: BranchCall, k: int, error: str) -> bool:
    """Record a call whose siblings could not be sampled: a `failed` group without members (visible,
    and the call is not tried again). False when the call is already branched."""
    group = dict(id=group_id, completion_id=call.completion_id, run_id=call.run_id, policy=call.policy,
                 policy_step=call.policy_step, k=k, with_original=False, reason=call.reason,
                 status=SiblingStatus.failed, attempts=0, error=f"sampling: {error}"[:2000],
                 created_at=datetime.now(UTC))  # fmt: skip
    return await _insert_group(engine, group)


async def scoring_groups(engine: AsyncEngine, *, limit: int = 16) -> list[ScoringGroup]:
    """Groups waiting for their scorer, oldest first, with the app's stored request and the members."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(
                    SiblingGroup.id,
                    SiblingGroup.policy,
                    SiblingGroup.attempts,
                    Completion.endpoint,
                    Completion.request,
                    Key.scorer_url,
                )  # fmt: skip
                .join(Completion, Completion.id == SiblingGroup.completion_id)
                .outerjoin(Key, Key.id == Completion.key_id)
                .where(SiblingGroup.status == SiblingStatus.scoring)
                .order_by(SiblingGroup.created_at, SiblingGroup.id)
                .limit(limit)
            )
        ).all()
        groups = [
            ScoringGroup(
                r.id, r.policy, int(r.attempts or 0), r.endpoint, r.request or {}, scorer_url=r.scorer_url
            )
            for r in rows
        ]
        if not groups:
            return []
        members = (
            await conn.execute(
                select(
                    Run.id,
                    Run.group_id,
                    Run.metadata_.label("meta"),
                    Completion.endpoint,
                    Completion.response,
                )
                .join(Completion, Completion.run_id == Run.id)
                .where(Run.group_id.in_([g.group_id for g in groups]), Run.branch_of.is_not(None))
            )
        ).all()
    by_group: dict[str, list[tuple[int, ScoringMember]]] = {}
    for m in members:
        meta = m.meta or {}
        member = ScoringMember(m.id, bool(meta.get("original")), m.endpoint, m.response)
        by_group.setdefault(m.group_id, []).append((int(meta.get("sibling_member", 0)), member))
    for g in groups:
        g.members = [m for _, m in sorted(by_group.get(g.group_id, []), key=lambda x: x[0])]
    return groups


async def store_scores(engine: AsyncEngine, group_id: str, scores: dict[str, float], scorer: str) -> int:
    """Each member's score (by run id) as its reward, `completed`, and the group `scored`, in ONE
    transaction; only a group still `scoring` changes. Returns the member runs changed."""
    now = datetime.now(UTC)
    changed = 0
    async with write_transaction(engine) as conn:
        res = await conn.execute(
            update(SiblingGroup)
            .where(SiblingGroup.id == group_id, SiblingGroup.status == SiblingStatus.scoring)
            .values(status=SiblingStatus.scored, scorer=scorer, scored_at=now, error=None)
        )
        if not res.rowcount:
            return 0
        for run_id, score in scores.items():
            res = await conn.execute(
                update(Run)
                .where(Run.id == run_id, Run.group_id == group_id)
                .where(Run.status.in_((RunStatus.open, RunStatus.expired)))  # expiry may pass a slow scorer
                .values(
                    reward=float(score),
                    reward_source=REWARD_SOURCE,
                    status=RunStatus.completed,
                    completed_at=now,
                )
            )
            changed += res.rowcount
    return changed


async def fail_scoring(engine: AsyncEngine, group_id: str, error: str, *, max_attempts: int) -> bool:
    """Count a failed scorer call; at `max_attempts` the group and its open runs become `failed`
    (`scorer_failed`). True when the group failed for good."""
    async with write_transaction(engine) as conn:
        attempts = await conn.scalar(
            select(SiblingGroup.attempts).where(
                SiblingGroup.id == group_id, SiblingGroup.status == SiblingStatus.scoring
            )
        )
        if attempts is None:
            return False
        attempts = int(attempts) + 1
        failed = attempts >= max_attempts
        values: dict[str, Any] = {"attempts": attempts, "error": error[:2000]}
        if failed:
            values["status"] = SiblingStatus.failed
            await conn.execute(
                update(Run)
                .where(Run.group_id == group_id, Run.branch_of.is_not(None))
                .where(Run.status.in_((RunStatus.open, RunStatus.expired)))
                .values(status=RunStatus.failed, status_reason=StatusReason.scorer_failed)
            )
        await conn.execute(update(SiblingGroup).where(SiblingGroup.id == group_id).values(**values))
    return failed
