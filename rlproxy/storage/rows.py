"""The rows one writer transaction writes: new runs, completions with their `seq`, rewards.

Plain async functions on a connection inside the writer's open transaction; the writer
(`writer.py`) owns the queue, the batching, the retries and the transaction itself, so nothing here
commits. `seq` numbers come from the run row's counter `runs.next_seq`, so writers in several
processes (replicas on one PostgreSQL) number a run's completions gapless (`ensure_runs`).
"""

from __future__ import annotations

import operator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from rlproxy.storage.errors import RewardConflict, RubricConflict, RunNotFound, SplitConflict
from rlproxy.storage.models import Completion, Run, RunStatus
from rlproxy.storage.records import COMPLETION_FIELDS, CompletionRecord

RUNS = Run.__table__
COMPLETIONS = Completion.__table__


async def stored_capture_ids(conn: AsyncConnection, capture_ids: list[str]) -> set[str]:
    """Which of `capture_ids` are stored already (a replayed journal record is stored once)."""
    query = select(COMPLETIONS.c.capture_id).where(COMPLETIONS.c.capture_id.in_(capture_ids))
    return set((await conn.execute(query)).scalars())


async def ensure_runs(conn: AsyncConnection, records: list[CompletionRecord]) -> dict[str, int]:
    """Create the rows of new runs and reserve each run's `seq` numbers; returns run id -> first seq.

    One upsert per batch, in run id order: `INSERT ... ON CONFLICT (id) DO UPDATE SET next_seq =
    runs.next_seq + n RETURNING id, next_seq`. The update locks each run row until the writer
    commits, so writers in other processes number the same run after this one (gapless, unique); the
    fixed order means two writers whose batches share runs wait for each other, never deadlock; a
    rolled-back transaction gives its numbers back. On SQLite the writer holds the write lock already
    (BEGIN IMMEDIATE): the same statement, no waiting.
    """
    first: dict[str, CompletionRecord] = {}
    count: dict[str, int] = {}
    for rec in records:
        if rec.run_id is not None:
            first.setdefault(rec.run_id, rec)
            count[rec.run_id] = count.get(rec.run_id, 0) + 1
    if not first:
        return {}
    rows = [
        {
            "id": rid,
            "group_id": rec.group_id or rec.default_group,
            "split": rec.split or "train",  # fixed by the run's first request (storage/validation.py)
            "policy": rec.policy,
            "status": RunStatus.open.value,
            "created_at": rec.created_at or datetime.now(UTC),
            "next_seq": count[rid],
        }
        for rid, rec in sorted(first.items())
    ]
    # One statement built once per dialect and executed with the rows as parameters: SQLAlchemy's
    # "insertmanyvalues" batches it from the cached compilation (a `.values(rows)` statement was
    # compiled anew for every batch size: milliseconds of the writer's Python per batch).
    stmt = _UPSERT_RUNS.get(conn.dialect.name)
    if stmt is None:
        dialect = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        ins = dialect(RUNS)
        stmt = _UPSERT_RUNS[conn.dialect.name] = ins.on_conflict_do_update(
            index_elements=[RUNS.c.id], set_={"next_seq": RUNS.c.next_seq + ins.excluded.next_seq}
        ).returning(RUNS.c.id, RUNS.c.next_seq)
    result = await conn.execute(stmt, rows)
    return {rid: int(nxt) - count[rid] for rid, nxt in result.all()}


_UPSERT_RUNS: dict[str, Any] = {}
_INSERT_COMPLETIONS = insert(COMPLETIONS)


async def repair_next_seq(conn: AsyncConnection, run_ids: list[str]) -> None:
    """Set `next_seq` of `run_ids` past their stored completions (after rows written around the counter,
    e.g. by a script: the unique (run_id, seq) constraint refused the writer's numbers)."""
    latest = (
        select(func.coalesce(func.max(COMPLETIONS.c.seq) + 1, 0))
        .where(COMPLETIONS.c.run_id == RUNS.c.id)
        .scalar_subquery()
    )
    await conn.execute(update(RUNS).where(RUNS.c.id.in_(sorted(set(run_ids)))).values(next_seq=latest))


async def insert_completions(
    conn: AsyncConnection, records: list[CompletionRecord], first_seq: dict[str, int], now: datetime
) -> int:
    """Insert `records` as `completions` rows, numbering each run's rows from `first_seq` (ensure_runs)
    in submission order; returns the rows written."""
    next_seq = dict(first_seq)
    seqs = []
    for rec in records:
        if rec.run_id is not None:
            seqs.append(next_seq[rec.run_id])
            next_seq[rec.run_id] += 1
        else:
            seqs.append(None)
    if not records:
        return 0
    if conn.dialect.name == "sqlite":  # the default store: SQLAlchemy's own value processing, once
        sql, values_of, at_seq, at_created, processors = _sqlite_insert(conn.dialect)
        rows = []
        for rec, seq in zip(records, seqs, strict=True):
            values = list(values_of(rec))
            values.insert(at_seq, seq)
            if rec.created_at is None:
                values[at_created] = now
            rows.append(
                tuple(v if p is None or v is None else p(v) for p, v in zip(processors, values, strict=True))
            )
        await conn.exec_driver_sql(sql, rows)
        return len(rows)
    rows = []
    for rec, seq in zip(records, seqs, strict=True):
        row = {f: getattr(rec, f) for f in COMPLETION_FIELDS}
        row["created_at"] = rec.created_at or now
        row["seq"] = seq
        rows.append(row)
    await conn.execute(_INSERT_COMPLETIONS, rows)
    return len(rows)


_SQLITE_INSERT: dict[int, tuple[Any, str, Any, int, int, list]] = {}  # id(dialect) -> (dialect, ...)


def _sqlite_insert(dialect: Any) -> tuple[str, Any, int, int, list]:
    """The completions INSERT for SQLite's driver: its SQL, a getter of a record's values in the
    statement's order (`seq` left out), where `seq` and `created_at` go, and each value's bind
    processor (None: as is), all of `dialect` (its JSON serializer).

    The same SQL and the same column values as `conn.execute(_INSERT_COMPLETIONS, rows)`, without
    SQLAlchemy's per-row parameter handling, which was a quarter of the writer process's CPU under
    tagged traffic (issue 24; tests/storage/test_rows_sqlite.py compares the rows byte for byte).
    A processor maps a non-NULL value (JSON text, a DATETIME string, a bool's 0/1); NULL stays NULL,
    as SQLAlchemy's processors (JSON with none_as_null) keep it.
    """
    made = _SQLITE_INSERT.get(id(dialect))
    if made is None or made[0] is not dialect:
        compiled = _INSERT_COMPLETIONS.compile(dialect=dialect, column_keys=[*COMPLETION_FIELDS, "seq"])
        fields = list(compiled.positiontup or ())  # qmark parameters: bound by position
        assert sorted(fields) == sorted([*COMPLETION_FIELDS, "seq"]), fields
        processors = [COMPLETIONS.c[n].type.dialect_impl(dialect).bind_processor(dialect) for n in fields]
        getter = operator.attrgetter(*[f for f in fields if f != "seq"])
        at_seq, at_created = fields.index("seq"), fields.index("created_at")
        made = _SQLITE_INSERT[id(dialect)] = (dialect, str(compiled), getter, at_seq, at_created, processors)
    return made[1:]


async def apply_reward(
    conn: AsyncConnection,
    run_id: str,
    reward: float | None,
    metrics: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
    now: datetime,
    rubric: str | None = None,
    split: str | None = None,
) -> bool | RunNotFound | RewardConflict | SplitConflict | RubricConflict:
    """Store a run's reward: True when stored, False when the same one was, else the error to raise.

    `reward` None asks for the judge's (trainer/judge.py): the run becomes `completed` with reward
    NULL and reward_source 'judge' (and `rubric` in judge_rubric) until the judge scores its group.
    `split` "val" (the reward body's) makes the run a validation run, as `X-Split: val` on its first
    request did: it becomes `validated`, never `completed` (storage/validation.py); None keeps its split.
    """
    row = (await conn.execute(_REWARD_READ, {"run": run_id})).first()
    if row is None:
        return RunNotFound(run_id)
    judged = row.reward_source == "judge"
    val = split == "val" or row.split == "val"
    if split == "train" and row.split == "val":
        return SplitConflict(run_id, "is a validation run (X-Split: val); refusing a train reward")
    if split == "val" and row.split != "val" and (row.reward is not None or judged):
        return SplitConflict(run_id, "was already rewarded as a training run; refusing split val")
    if val and reward is None:
        return SplitConflict(run_id, "is a validation run: post a number (the judge scores training runs)")
    if reward is None:
        if judged:  # asked for before (scored or not): the same request again
            return False
        if row.reward is not None:
            return RewardConflict(run_id, row.reward, None)
        if await _other_rubric(conn, run_id, row.policy, row.group_id, rubric):
            return RubricConflict(run_id, row.group_id)
    elif judged and row.reward is None:
        return RewardConflict(run_id, None, reward)
    elif row.reward is not None:
        # judge=always keeps the app's number in metrics.app_reward when the judge replaces it
        app = (row.metrics or {}).get("app_reward") if judged else row.reward
        if app is not None and float(app) == reward:
            return False
        return RewardConflict(run_id, row.reward, reward)
    # A late reward revives an expired run; a run the trainer already judged keeps its status.
    rewarded = RunStatus.validated.value if val else RunStatus.completed.value  # val: never trained
    status = rewarded if row.status in (RunStatus.open, RunStatus.expired) else row.status
    values = {
        "run": run_id,
        "reward": reward,
        "metrics": metrics,
        "metadata": metadata,
        "completed_at": now,
        "status": status,
        "split": "val" if val else "train",
        "reward_source": "app" if reward is not None else "judge",
    }
    if reward is None:
        values["judge_rubric"] = rubric
    await conn.execute(_REWARD_WRITE, values)
    return True


# Built once: a statement built per call cost more Python (coercions, cache keys) than the SQL itself
# (issue 24: ~1 ms of the writer's CPU per reward). The UPDATE's SET columns are the parameters'.
# FOR NO KEY UPDATE (PostgreSQL; SQLite's writer holds the write lock already): a reward racing on
# another replica waits here for this transaction, then reads what it stored (200 vs 409).
_REWARD_READ = (
    select(
        RUNS.c.reward,
        RUNS.c.status,
        RUNS.c.reward_source,
        RUNS.c.metrics,
        RUNS.c.split,
        RUNS.c.policy,
        RUNS.c.group_id,
    )
    .where(RUNS.c.id == bindparam("run"))
    .with_for_update(key_share=True)
)
_REWARD_WRITE = update(RUNS).where(RUNS.c.id == bindparam("run"))


async def _other_rubric(
    conn: AsyncConnection, run_id: str, policy: str | None, group_id: str | None, rubric: str | None
) -> bool:
    """True when another run of the group, completed for the judge and not yet trained, asked for a
    different rubric (None, the policy's rubric, counts as one): one rubric per judged group."""
    query = (
        select(RUNS.c.judge_rubric)
        .where(RUNS.c.policy == policy, RUNS.c.group_id == group_id, RUNS.c.id != run_id)
        .where(RUNS.c.reward_source == "judge", RUNS.c.status == RunStatus.completed.value)
        .distinct()
        .limit(3)
    )
    return any(r != rubric for r in (await conn.execute(query)).scalars())
