"""The reads the dashboard digs in with: runs under filters (with a total, for paging), the reward
of every group over time (the skipped ones included), one call's sampled tokens with its run's
cohort, and two steps side by side on the validation prompts.

`find_runs` is `queries.list_runs` with every filter a user reaches for (status, policy, group,
split, reward range, time range, an id substring) and offset paging with a total count, for an
operator's page (not the agents' cursor API). `group_rewards` is one row per rewarded group of the
training split and outcome (trained at step N, skipped with its reason, failed, waiting, ungrouped):
the curve of what the app's rewards did, whether or not a training step ever came of it, counted
as the status cards count runs. `completion_tokens` and `compare_val` feed the token view and the
comparison of steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import and_, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.models import Completion, Run
from rlproxy.storage.times import aware, iso

RUNS = Run.__table__
COMPLETIONS = Completion.__table__
MAX_LIMIT = 1000


@dataclass(frozen=True)
class RunFilter:
    """The runs page's filters as its query string names them (None or "": no filter).

    `since`/`until` bound `created_at` (ISO 8601 text); `q` is a substring of the run id (case-sensitive).
    """

    status: str | None = None
    policy: str | None = None
    group_id: str | None = None
    split: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    since: str | None = None
    until: str | None = None
    q: str | None = None


def _when(engine: AsyncEngine, value: str, name: str) -> datetime:
    """A bound for a time column (SQLite compares naive UTC text, PostgreSQL aware datetimes).

    Raises ValueError(name) when `value` is not an ISO 8601 time."""
    try:
        v = aware(datetime.fromisoformat(value.replace("Z", "+00:00"))).astimezone(UTC)
    except ValueError:
        raise ValueError(name) from None
    return v.replace(tzinfo=None) if engine.dialect.name == "sqlite" else v


async def find_runs(
    engine: AsyncEngine, f: RunFilter, limit: int = 50, offset: int = 0
) -> tuple[list[dict[str, Any]], int]:
    """Runs newest first under every filter of `f`, and how many match in all; ValueError(name) for
    a time that is not ISO 8601."""
    limit = max(1, min(int(limit), MAX_LIMIT))
    conds = [
        c == v
        for c, v in (
            (RUNS.c.status, f.status),
            (RUNS.c.policy, f.policy),
            (RUNS.c.group_id, f.group_id),
            (RUNS.c.split, f.split),
        )
        if v
    ]
    if f.min_reward is not None:
        conds.append(RUNS.c.reward >= f.min_reward)
    if f.max_reward is not None:
        conds.append(RUNS.c.reward <= f.max_reward)
    if f.since:
        conds.append(RUNS.c.created_at >= _when(engine, f.since, "since"))
    if f.until:
        conds.append(RUNS.c.created_at <= _when(engine, f.until, "until"))
    if f.q:
        conds.append(
            func.instr(RUNS.c.id, f.q) > 0 if engine.dialect.name == "sqlite" else RUNS.c.id.contains(f.q)
        )
    where = and_(True, *conds)
    n_completions = (
        select(func.count())
        .select_from(COMPLETIONS)
        .where(COMPLETIONS.c.run_id == RUNS.c.id)
        .scalar_subquery()
        .label("n_completions")
    )
    page = (
        select(RUNS, n_completions)
        .where(where)
        .order_by(RUNS.c.created_at.desc(), RUNS.c.id.desc())
        .limit(limit)
        .offset(max(0, int(offset)))
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(page)).mappings().all()
        total = await conn.scalar(select(func.count()).select_from(RUNS).where(where))
    return [{str(k): iso(v, text=True) for k, v in r.items() if k != "next_seq"} for r in rows], int(
        total or 0
    )


# What became of a rewarded training run, by its status: the chart's point kinds. The run counts per
# outcome are the status cards' counts of those statuses (`completed` is drawn as "waiting").
OUTCOMES: dict[str, str] = {
    "trained": "trained",
    "skipped": "skipped",
    "failed": "failed",
    "completed": "waiting",
    "ungrouped": "ungrouped",
}


async def group_rewards(
    engine: AsyncEngine, *, policy: str | None = None, limit: int = 1000
) -> list[dict[str, Any]]:
    """The newest `limit` points of the group chart, oldest first: one per (group, policy, status,
    trained step) of the rewarded training runs. A group_id whose runs the trainer took in several
    batches (a fixed prompt: 8 trained at step 1, 8 skipped later) is several points, each the mean
    of its own runs, so a point's `runs` summed per `outcome` equal the runs per status.

    Each point: `group_id`, `policy`, `status` (the runs'), `outcome` (`OUTCOMES`), `at` (its last
    reward), `runs`, `mean_reward`, `min_reward`, `max_reward`, `trained_step` and `reason` (why the
    trainer set the status: zero_variance, no_sibling, ...)."""
    query = (
        select(
            RUNS.c.group_id,
            RUNS.c.policy,
            RUNS.c.status,
            RUNS.c.trained_step,
            func.max(RUNS.c.completed_at).label("at"),
            func.count().label("runs"),
            func.avg(RUNS.c.reward).label("mean_reward"),
            func.min(RUNS.c.reward).label("min_reward"),
            func.max(RUNS.c.reward).label("max_reward"),
            func.max(RUNS.c.status_reason).label("reason"),
        )
        .where(RUNS.c.reward.is_not(None), RUNS.c.split == "train", RUNS.c.completed_at.is_not(None))
        .where(RUNS.c.status.in_(tuple(OUTCOMES)))
        .group_by(RUNS.c.group_id, RUNS.c.policy, RUNS.c.status, RUNS.c.trained_step)
        .order_by(func.max(RUNS.c.completed_at).desc())
        .limit(max(1, min(int(limit), 10_000)))
    )
    if policy is not None:
        query = query.where(RUNS.c.policy == policy)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    return [
        {
            "group_id": r["group_id"],
            "policy": r["policy"],
            "status": r["status"],
            "outcome": OUTCOMES[r["status"]],
            "at": iso(r["at"], text=True),
            "runs": int(r["runs"]),
            "mean_reward": float(r["mean_reward"]),
            "min_reward": float(r["min_reward"]),
            "max_reward": float(r["max_reward"]),
            "trained_step": r["trained_step"],
            "reason": r["reason"],
        }
        for r in reversed(rows)
    ]


async def outcome_runs(engine: AsyncEngine, *, policy: str | None = None) -> dict[str, int]:
    """Rewarded training runs per outcome (`OUTCOMES`), all of them: the group chart's caption, which
    stays equal to the status cards however many points `group_rewards` was limited to."""
    query = (
        select(RUNS.c.status, func.count())
        .where(RUNS.c.reward.is_not(None), RUNS.c.split == "train", RUNS.c.completed_at.is_not(None))
        .where(RUNS.c.status.in_(tuple(OUTCOMES)))
        .group_by(RUNS.c.status)
    )
    if policy is not None:
        query = query.where(RUNS.c.policy == policy)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    out = dict.fromkeys(OUTCOMES.values(), 0)
    for status, n in rows:
        out[OUTCOMES[status]] += int(n)
    return out


async def fullest_waiting_group(engine: AsyncEngine) -> tuple[str, str, int] | None:
    """(policy, group_id, rewarded runs) of the group of rewarded, untrained training runs that holds
    the most (the newest on a tie): what the trainer waits on. None when no run waits."""
    n = func.count().label("n")
    query = (
        select(RUNS.c.policy, RUNS.c.group_id, n)
        .where(RUNS.c.status == "completed", RUNS.c.reward.is_not(None), RUNS.c.split == "train")
        .where(RUNS.c.group_id.is_not(None))
        .group_by(RUNS.c.policy, RUNS.c.group_id)
        .order_by(n.desc(), func.max(RUNS.c.completed_at).desc())
        .limit(1)
    )
    async with engine.connect() as conn:
        row = (await conn.execute(query)).first()
    return (row.policy, row.group_id, int(row.n)) if row is not None else None


async def completion_tokens(engine: AsyncEngine, completion_id: int) -> dict[str, Any] | None:
    """One call's sampled tokens and what its run made of them, for the dashboard's token view; None
    when there is no such completion.

    `token_ids` and `logprobs` are lists per choice as stored; `text` the answer's text per choice;
    `run` the run's reward, status and trained step; `cohort` the runs its advantage was measured
    against: the run's group at the step that trained it (else its group's runs of the same status),
    their count, mean and sample std. Advantages are not stored (the trainer computes them per step):
    `reward - mean` is what the page can show, and says so."""
    async with engine.connect() as conn:
        c = (
            (await conn.execute(select(COMPLETIONS).where(COMPLETIONS.c.id == completion_id)))
            .mappings()
            .first()
        )
        if c is None:
            return None
        run = None
        if c["run_id"] is not None:
            run = (await conn.execute(select(RUNS).where(RUNS.c.id == c["run_id"]))).mappings().first()
        cohort = None
        if run is not None and run["reward"] is not None:
            same = (
                RUNS.c.trained_step == run["trained_step"]
                if run["trained_step"] is not None
                else RUNS.c.status == run["status"]
            )
            rewards = (
                await conn.execute(
                    select(RUNS.c.reward).where(
                        RUNS.c.policy == run["policy"],
                        RUNS.c.group_id == run["group_id"],
                        RUNS.c.reward.is_not(None),
                        RUNS.c.split == run["split"],
                        same,
                    )
                )
            ).scalars()
            cohort = _spread([float(r) for r in rewards])
    choices = ((c["response"] or {}).get("choices") or []) if isinstance(c["response"], dict) else []
    text = [ch.get("text") if "text" in ch else (ch.get("message") or {}).get("content") for ch in choices]
    return {
        "id": c["id"],
        "run_id": c["run_id"],
        "seq": c["seq"],
        "policy": c["policy"],
        "policy_step": c["policy_step"],
        "endpoint": c["endpoint"],
        "finish_reason": c["finish_reason"],
        "prompt_tokens": len(c["prompt_token_ids"] or []),
        "token_ids": c["token_ids"] or [],
        "logprobs": c["logprobs"] or [],
        "text": text,
        "run": None
        if run is None
        else {
            k: iso(run[k], text=True)
            for k in ("id", "group_id", "status", "status_reason", "reward", "trained_step")
        },
        "cohort": cohort,
    }


def _spread(rewards: list[float]) -> dict[str, Any]:
    n = len(rewards)
    mean = sum(rewards) / n if n else None
    std = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5 if n > 1 and mean is not None else None
    return {"runs": n, "mean_reward": mean, "std_reward": std}


def parse_arm(value: str | None) -> tuple[str, int] | None:
    """`policy@step` -> (policy, step); None for None."""
    if not value:
        return None
    policy, _, step = value.rpartition("@")
    if not policy or not (step.isascii() and step.isdigit() and len(step) < 19):  # a step fits 64 bits
        raise ValueError(f"{value!r}: expected policy@step, e.g. tiny@3")
    return policy, int(step)


async def compare_val(
    engine: AsyncEngine, a: str | None = None, b: str | None = None, *, limit: int = 5000
) -> dict[str, Any]:
    """Two steps or policies side by side on the same validation prompts (runs with split `val`).

    An arm is `policy@step`: the rewarded val runs of `policy` whose every call `step` served (the
    step that trained them is 0 for the base model). Runs are matched by prompt: the exact prompt
    token ids of their first call (so two policies on one base model meet), else their group id.
    Returns `arms` (every arm with val runs, newest step first: the pickers), the chosen `a` and `b`
    (default: the two newest arms) with their mean over the shared prompts, and `prompts`: one row
    per prompt both arms answered (`prompt` text, `a_mean`, `a_runs`, `b_mean`, `b_runs`, `diff` =
    b - a), largest change first. `limit` bounds the val runs read (the newest)."""
    first = (
        select(
            COMPLETIONS.c.run_id,
            func.min(COMPLETIONS.c.policy_step).label("lo"),
            func.max(COMPLETIONS.c.policy_step).label("hi"),
            func.min(COMPLETIONS.c.seq).label("seq0"),
        )
        .where(COMPLETIONS.c.run_id.in_(select(RUNS.c.id).where(RUNS.c.split == "val")))
        .group_by(COMPLETIONS.c.run_id)
        .subquery()
    )
    query = (
        select(RUNS.c.id, RUNS.c.policy, RUNS.c.group_id, RUNS.c.reward, first.c.lo, first.c.hi, first.c.seq0)
        .join(first, first.c.run_id == RUNS.c.id)
        .where(RUNS.c.split == "val", RUNS.c.status == "validated", RUNS.c.reward.is_not(None))
        .order_by(RUNS.c.completed_at.desc())
        .limit(max(1, min(int(limit), 50_000)))
    )
    async with engine.connect() as conn:
        runs = [r for r in (await conn.execute(query)).mappings().all() if r["lo"] == r["hi"]]
        counts: dict[tuple[str, int], int] = {}
        for r in runs:
            counts[(r["policy"], int(r["lo"]))] = counts.get((r["policy"], int(r["lo"])), 0) + 1
        arms = sorted(counts, key=lambda k: (-k[1], k[0]))
        pick_a, pick_b = parse_arm(a), parse_arm(b)
        if pick_b is None:
            pick_b = arms[0] if arms else None
        if pick_a is None:
            pick_a = next((k for k in arms if k != pick_b and k[0] == (pick_b or ("",))[0]), None)
            pick_a = pick_a or next((k for k in arms if k != pick_b), None)
        chosen = [r for r in runs if (r["policy"], int(r["lo"])) in (pick_a, pick_b)]
        firsts = {}
        if chosen:
            rows = await conn.execute(
                select(COMPLETIONS.c.run_id, COMPLETIONS.c.prompt_token_ids, COMPLETIONS.c.request)
                .join(first, and_(first.c.run_id == COMPLETIONS.c.run_id, first.c.seq0 == COMPLETIONS.c.seq))
                .where(COMPLETIONS.c.run_id.in_([r["id"] for r in chosen]))
            )
            firsts = {row.run_id: (row.prompt_token_ids, row.request) for row in rows}
    by_prompt: dict[str, dict[str, Any]] = {}
    for r in chosen:
        ids, request = firsts.get(r["id"], (None, None))
        key = f"ids:{ids}" if ids else f"group:{r['group_id']}"
        row = by_prompt.setdefault(key, {"prompt": _prompt_text(request), "a": [], "b": []})
        row["a" if (r["policy"], int(r["lo"])) == pick_a else "b"].append(float(r["reward"]))
    prompts = []
    for row in by_prompt.values():
        if not (row["a"] and row["b"]):
            continue
        am, bm = sum(row["a"]) / len(row["a"]), sum(row["b"]) / len(row["b"])
        prompts.append(
            {
                "prompt": row["prompt"],
                "a_mean": am,
                "a_runs": len(row["a"]),
                "b_mean": bm,
                "b_runs": len(row["b"]),
                "diff": bm - am,
            }
        )
    prompts.sort(key=lambda p: (-abs(p["diff"]), p["prompt"] or ""))

    def side(arm: tuple[str, int] | None, k: str) -> dict[str, Any] | None:
        if arm is None:
            return None
        means = [p[f"{k}_mean"] for p in prompts]
        return {
            "policy": arm[0],
            "step": arm[1],
            "runs": counts.get(arm, 0),
            "mean_reward": sum(means) / len(means) if means else None,
        }

    return {
        "object": "val_comparison",
        "arms": [{"policy": p, "step": s, "runs": counts[(p, s)]} for p, s in arms],
        "a": side(pick_a, "a"),
        "b": side(pick_b, "b"),
        "prompts": prompts,
    }


def _prompt_text(request: Any) -> str | None:
    """The last user message (or the prompt) of a stored request body, as the comparison's label."""
    if not isinstance(request, dict):
        return None
    for m in reversed(request.get("messages") or []):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            return content if isinstance(content, str) else orjson.dumps(content).decode()
    prompt = request.get("prompt")
    return prompt if isinstance(prompt, str) else None
