"""The judge's queries: which groups wait for the judge, what they hold, and storing its scores.

A run completed without a number (`POST /v1/runs/{id}/complete`) is `completed` with `reward` NULL
and `reward_source` 'judge'. Its group waits for the judge under the trainer's readiness rule
(`group_size` completed runs, or its newest completion older than `group_timeout`), except that a
run still alone past `group_timeout` is judged alone, so that nothing waits forever (it then
becomes `ungrouped` like any lone rewarded run). Under `judge=always` a group of app-rewarded runs
waits for the judge as well, until every run's `reward_source` is 'judge'.

Tenancy (issue 22): under `judge=missing` (the default) the judge sees and scores only the runs
that asked for it (reward_source 'judge'): a run that joins another's group and asks for the judge
never re-scores the group's app-rewarded runs, and a judge that fails fails only the runs that asked.
Only `judge=always`, the operator's choice for a policy, puts app-rewarded runs before the judge.

`store_scores` writes a group's scores in one transaction: `reward`, `reward_source='judge'`,
`judge_explanation`, and (only with `replace_app`, judge=always) the app's number moved to
`metrics.app_reward`. Only runs still `completed` change, so a run trained, skipped or failed
meanwhile keeps what it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import case, func, select, update

from rlproxy.storage.db import pg_text
from rlproxy.storage.models import Completion, Run, RunStatus
from rlproxy.storage.training import _aware, _status_is, _write, group_ready


@dataclass
class JudgeRun:
    """One run shown to the judge: its conversation (the `trajectories` view's `messages`)."""

    run_id: str
    reward: float | None
    reward_source: str | None
    rubric: str | None  # the complete request's rubric, None: the policy's
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class JudgeGroup:
    """A group the judge scores together, oldest completion first."""

    policy: str
    group_id: str
    runs: list[JudgeRun]

    @property
    def run_ids(self) -> list[str]:
        return [r.run_id for r in self.runs]


def _messages(request: dict[str, Any] | None, response: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The conversation of a run's last completion: its request's messages and the answer (like the
    `trajectories` view), or the prompt and text of a /v1/completions call."""
    request, response = request or {}, response or {}
    choice = (response.get("choices") or [{}])[0] or {}
    if isinstance(request.get("messages"), list):
        out = [m for m in request["messages"] if isinstance(m, dict)]
        if isinstance(choice.get("message"), dict):
            out.append(choice["message"])
        return out
    prompt = request.get("prompt")
    out = [{"role": "user", "content": prompt if isinstance(prompt, str) else str(prompt)}]
    if isinstance(choice.get("text"), str):
        out.append({"role": "assistant", "content": choice["text"]})
    return out


async def judge_groups(
    engine: Any,
    *,
    group_size: int,
    group_timeout: float,
    mode_of: Callable[[str], str] = lambda _policy: "missing",
    now: datetime | None = None,
) -> list[JudgeGroup]:
    """Every group the judge should see now, the one waiting longest first.

    A group qualifies when it holds a run waiting for the judge (reward NULL, reward_source 'judge'),
    or, when `mode_of(policy)` is 'always', a run the judge has not scored. Groups of policies whose
    mode is 'off' qualify only by their waiting runs (the caller fails those: nobody will judge them).
    """
    now = now or datetime.now(UTC)
    judged = Run.reward_source == "judge"
    newest = func.max(func.coalesce(Run.completed_at, Run.created_at))
    newest_judged = func.max(case((judged, func.coalesce(Run.completed_at, Run.created_at)), else_=None))
    waiting = func.sum(case((Run.reward.is_(None), 1), else_=0))
    unjudged = func.sum(case((judged, 0), else_=1))
    q = (
        select(
            Run.policy,
            Run.group_id,
            func.count().label("n"),
            func.sum(case((judged, 1), else_=0)).label("n_judged"),
            newest.label("newest"),
            newest_judged.label("newest_judged"),
            waiting.label("waiting"),
            unjudged.label("unjudged"),
        )
        .where(_status_is(engine, RunStatus.completed), Run.group_id.is_not(None), Run.policy.is_not(None))
        .where(Run.reward.is_not(None) | judged)
        .where(Run.branch_of.is_(None))  # sibling groups have their own scorer (storage/siblings.py)
        .group_by(Run.policy, Run.group_id)
    )
    cutoff = now - timedelta(seconds=group_timeout)
    keys = []
    async with engine.connect() as conn:
        for r in (await conn.execute(q)).all():
            always = mode_of(r.policy) == "always"
            if not (r.waiting or (always and r.unjudged)):
                continue
            n, at = (r.n, _aware(r.newest)) if always else (r.n_judged, _aware(r.newest_judged))
            if group_ready(n, at, group_size, cutoff):
                keys.append((at or now, r.policy, r.group_id, always))
        keys.sort(key=lambda k: k[0])
        groups = []
        for _, policy, gid, always in keys:
            members_q = (
                select(Run.id, Run.reward, Run.reward_source, Run.judge_rubric)
                .where(Run.policy == policy, Run.group_id == gid, Run.status == RunStatus.completed)
                .where(Run.reward.is_not(None) | judged)
                .order_by(Run.completed_at, Run.id)
            )
            if not always:  # only the runs that asked for the judge (module doc: tenancy)
                members_q = members_q.where(judged)
            runs = (await conn.execute(members_q)).all()
            members = [JudgeRun(r.id, r.reward, r.reward_source, r.judge_rubric) for r in runs]
            # each run's last completion: its messages hold the whole conversation so far
            last = (
                select(Completion.run_id, func.max(Completion.seq).label("seq"))
                .where(Completion.run_id.in_([m.run_id for m in members]))
                .group_by(Completion.run_id)
                .subquery()
            )
            rows = (
                await conn.execute(
                    select(Completion.run_id, Completion.request, Completion.response).join(
                        last, (Completion.run_id == last.c.run_id) & (Completion.seq == last.c.seq)
                    )
                )
            ).all()
            convo = {row.run_id: _messages(row.request, row.response) for row in rows}
            for m in members:
                m.messages = convo.get(m.run_id, [])
            if members:
                groups.append(JudgeGroup(policy, gid, members))
    return groups


async def store_scores(
    engine: Any, scores: dict[str, tuple[float, str]], *, replace_app: bool = False
) -> int:
    """Store the judge's (score, explanation) per run id as its reward, in one transaction. Only runs
    that asked for the judge change, unless `replace_app` (judge=always): then an app's earlier number
    moves to `metrics.app_reward`. Returns the runs changed (only `completed` ones)."""
    if not scores:
        return 0
    changed = 0
    async with _write(engine) as conn:
        rows = (
            await conn.execute(
                select(Run.id, Run.reward, Run.reward_source, Run.metrics).where(
                    Run.id.in_(list(scores)), Run.status == RunStatus.completed
                )
            )
        ).all()
        if not replace_app:  # never another run's app reward (module doc: tenancy)
            rows = [row for row in rows if row.reward_source == "judge"]
        pg = conn.dialect.name == "postgresql"
        for row in rows:
            score, explanation = scores[row.id]
            values: dict[str, Any] = {
                "reward": float(score),
                "reward_source": "judge",
                # a model's text: U+0000 is U+FFFD on PostgreSQL, as in completions (db._pg_json_dumps)
                "judge_explanation": pg_text(explanation)
                if pg and isinstance(explanation, str)
                else explanation,
            }
            if row.reward is not None and row.reward_source != "judge":
                values["metrics"] = {**(row.metrics or {}), "app_reward": float(row.reward)}
            res = await conn.execute(
                update(Run).where(Run.id == row.id, Run.status == RunStatus.completed).values(**values)
            )
            changed += res.rowcount
    return changed
