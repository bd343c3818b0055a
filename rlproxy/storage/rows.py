"""The rows one writer transaction writes: new runs, completions with their `seq`, rewards.

Plain async functions on a connection inside the writer's open transaction; the writer
(`writer.py`) owns the queue, the batching, the retries and the transaction itself, so nothing here
commits. `seq` numbers come from the run row's counter `runs.next_seq`, so writers in several
processes (replicas on one PostgreSQL) number a run's completions gapless (`ensure_runs`).
"""

from __future__ import annotations

import collections
import operator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, bindparam, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from rlproxy.storage.db import pg_text
from rlproxy.storage.errors import RewardConflict, RubricConflict, RunNotFound, SplitConflict
from rlproxy.storage.models import Completion, Run, RunStatus
from rlproxy.storage.records import COMPLETION_FIELDS, CompletionRecord, default_group

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
            "group_id": rec.group_id or rec.default_group or group_of(rec),
            "split": rec.split or "train",  # fixed by the run's first request (storage/validation.py)
            "policy": rec.policy,
            "status": RunStatus.open.value,
            "created_at": rec.created_at or datetime.now(UTC),
            "next_seq": count[rid],
            "key_id": rec.key_id,
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


def group_of(rec: CompletionRecord) -> str | None:
    """The group of a run its first completion names none for (`records.default_group`); hashed
    here, once a run per batch, rather than on every tagged request in the serving process (and by
    the live OTLP export, off the serving path too)."""
    if not isinstance(rec.request, dict):
        return None
    group = default_group(rec.policy, rec.request)
    return group if rec.key_id is None else f"{rec.key_id}~{group}"  # an app's groups are its own


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
    if conn.dialect.name == "sqlite":  # the default store: the values bound as SQLAlchemy binds them
        lite, values_of, at_seq, at_created = _sqlite_insert(conn.dialect)
        rows = []
        for rec, seq in zip(records, seqs, strict=True):
            values = list(values_of(rec))
            values.insert(at_seq, seq)
            if rec.created_at is None:
                values[at_created] = now
            rows.append(lite.bind(values))
        await conn.exec_driver_sql(lite.sql, rows)
        return len(rows)
    rows = []
    for rec, seq in zip(records, seqs, strict=True):
        # text columns too: an upstream's error body or finish reason may hold U+0000 (db._pg_json_dumps)
        row = {}
        for f in COMPLETION_FIELDS:
            value = getattr(rec, f)
            row[f] = pg_text(value) if type(value) is str else value
        row["created_at"] = rec.created_at or now
        row["seq"] = seq
        rows.append(row)
    await conn.execute(_INSERT_COMPLETIONS, rows)
    return len(rows)


class _Lite:
    """A statement compiled once for SQLite's driver and run on it directly (`InlineConnection.driver`):
    its SQL, its parameters' names in order, how SQLAlchemy would bind each non-NULL value
    (`convert`: (position, function), for the values it processes: JSON text, a DATETIME string, a
    bool's 0/1) and process each result column (`load`).

    Why: SQLAlchemy's execution context costs ~45 us a statement in Python, several times SQLite's own
    work for a one-row statement (issue 24: a reward's two statements were ~0.1 ms of the writer
    process's CPU; the completions' per-row parameter handling a quarter of it). The SQL and the
    values are SQLAlchemy's own: tests/storage/test_rows_sqlite.py compares the rows byte for byte.
    """

    def __init__(self, stmt: Any, dialect: Any, keys: list[str] | None = None) -> None:
        compiled = stmt.compile(dialect=dialect, column_keys=keys)
        self.sql = str(compiled)
        self.names = list(compiled.positiontup or ())  # qmark parameters: bound by position
        self.convert = []
        for i, name in enumerate(self.names):
            impl = compiled.binds[name].type.dialect_impl(dialect)
            processor = impl.bind_processor(dialect)
            if processor is not None:
                self.convert.append((i, _fast(impl, processor, dialect)))
        columns = getattr(stmt, "selected_columns", ())
        self.load = [
            (i, p)
            for i, c in enumerate(columns)
            if (p := c.type.dialect_impl(dialect).result_processor(dialect, None))
        ]

    def bind(self, values: list) -> tuple:
        """`values` (in `names` order) as the driver takes them."""
        for i, to_sql in self.convert:
            v = values[i]
            if v is not None:
                values[i] = to_sql(v)
        return tuple(values)

    def run(self, conn: Any, params: dict[str, Any]) -> Any:
        """Execute with `params` by name on `conn`'s driver connection; the first row (processed), or None."""
        row = conn.driver(self.sql, self.bind([params[n] for n in self.names])).fetchone()
        if row is None or not self.load:
            return row
        row = list(row)
        for i, load in self.load:
            row[i] = load(row[i])
        return row


_LITE: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id(dialect), what) -> (dialect, made)


def _lite(dialect: Any, what: str, make: Any) -> Any:
    """`make(dialect)` once per dialect (SQLite's: its JSON serializer is the engine's)."""
    made = _LITE.get((id(dialect), what))
    if made is None or made[0] is not dialect:
        made = _LITE[(id(dialect), what)] = (dialect, make(dialect))
    return made[1]


def _sqlite_insert(dialect: Any) -> tuple[_Lite, Any, int, int]:
    """The completions INSERT for SQLite's driver (`_Lite`), a getter of a record's values in the
    statement's order (`seq` left out), and where `seq` and `created_at` go."""

    def make(dialect: Any) -> tuple[_Lite, Any, int, int]:
        lite = _Lite(_INSERT_COMPLETIONS, dialect, [*COMPLETION_FIELDS, "seq"])
        fields = lite.names
        assert sorted(fields) == sorted([*COMPLETION_FIELDS, "seq"]), fields
        getter = operator.attrgetter(*[f for f in fields if f != "seq"])
        return lite, getter, fields.index("seq"), fields.index("created_at")

    return _lite(dialect, "insert", make)


_SAMPLES = {  # what `_fast` must turn into exactly what SQLAlchemy's processor makes of it
    "json": ({"a": [1, 2.5, None, True, 'é \u2028 "q"'], "b": {}}, [[-0.5, float("-inf")]], "s", 3),
    "datetime": (
        datetime(2026, 12, 6, 5, 0, 0, 123456, tzinfo=UTC),
        datetime(2026, 12, 6, 5, 0, 0, tzinfo=UTC),
        datetime(999, 1, 2, 3, 4, 5, 6),
    ),
}


def _fast(impl: Any, processor: Any, dialect: Any) -> Any:
    """`processor` (a column's bind processor), or a cheaper function that gives the same text for
    every value the records hold: a JSON column's serializer alone, a DATETIME's `isoformat` (a
    date, or anything else, still goes to `processor`). Used only if it agrees on `_SAMPLES`."""
    fast = None
    kind = None
    if isinstance(impl, JSON) and dialect._json_serializer is not None:
        fast, kind = dialect._json_serializer, "json"
    elif isinstance(impl, DateTime):

        def fast(value: Any) -> Any:
            if type(value) is datetime:
                return value.isoformat(" ", "microseconds")[:26]  # the zone dropped, as SQLAlchemy does
            return processor(value)

        kind = "datetime"
    if fast is None or any(fast(v) != processor(v) for v in _SAMPLES[kind]):
        return processor
    return fast


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
    fast = hasattr(conn, "driver") and conn.dialect.name == "sqlite"  # the writer's own SQLite connection
    if fast:
        row = _lite(conn.dialect, "reward_read", lambda d: _Lite(_REWARD_READ, d)).run(conn, {"run": run_id})
        row = None if row is None else _RewardRow(*row)
    else:
        row = (await conn.execute(_REWARD_READ, {"run": run_id})).first()
    if row is None or row.branch_of is not None:  # a sibling member is the proxy's, scored by its scorer
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
    if fast:
        keys = sorted(k for k in values if k != "run")
        what = "reward_write:" + ",".join(keys)
        _lite(conn.dialect, what, lambda d: _Lite(_REWARD_WRITE, d, keys)).run(conn, values)
    else:
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
        RUNS.c.branch_of,
    )
    .where(RUNS.c.id == bindparam("run"))
    .with_for_update(key_share=True)
)
_REWARD_WRITE = update(RUNS).where(RUNS.c.id == bindparam("run"))
_RewardRow = collections.namedtuple("_RewardRow", [c.name for c in _REWARD_READ.selected_columns])


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
