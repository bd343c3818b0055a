"""The SQLite store's completions INSERT (`rows.insert_completions`): the writer binds the values
itself, with SQLAlchemy's own bind processors, instead of SQLAlchemy's per-row parameter handling
(issue 24: a quarter of the writer process's CPU). Here the same records go through both, into two
real SQLite files of the current schema, and every column must come out the same: value and storage
class (`typeof`), byte for byte."""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

from rlproxy.storage import db
from rlproxy.storage.records import COMPLETION_FIELDS, CompletionRecord
from rlproxy.storage.rows import _INSERT_COMPLETIONS, apply_reward, ensure_runs, insert_completions

NOW = datetime(2026, 12, 6, 5, 0, 0, 123456, tzinfo=UTC)


def records() -> list[CompletionRecord]:
    return [
        CompletionRecord(
            run_id="r-1",
            policy="p",
            adapter="p@3",
            policy_step=3,
            endpoint="chat.completions",
            stream=True,
            request={
                "messages": [{"role": "user", "content": 'héllo \u2028 "q" \\ ☃'}],
                "n": 2**53,
                "x": 1.5e-7,
            },
            response={"choices": [{"message": {"content": "a", "tool_calls": None}}], "usage": {}},
            prompt_token_ids=[1, 2, 3],
            token_ids=[[4, 5], []],
            logprobs=[[-0.25, float("-inf"), float("nan")], []],
            finish_reason="stop",
            status="ok",
            status_code=200,
            latency_ms=12.5,
            ttft_ms=3,
            prompt_tokens=3,
            completion_tokens=2,
            created_at=datetime(2026, 12, 6, 4, 59, 59, tzinfo=UTC),  # no microseconds
            capture_id="c-1",
        ),
        CompletionRecord(  # untagged, nothing but the defaults; created_at from the batch's `now`
            run_id=None,
            endpoint="completions",
            stream=False,
            status="error",
            status_code=502,
            error="ünïcode ✓",
            capture_id="c-2",
        ),
        CompletionRecord(  # a Responses call, a hosted row, another zone's clock
            run_id="r-1",
            endpoint="responses",
            request={},
            client_request={"input": [{"type": "message", "content": []}], "store": False},
            client_response={"id": "resp_1", "output": [], "metadata": {"k": "v"}},
            response_id="resp_1",
            source="hosted",
            latency_ms=0.0,
            created_at=datetime(2026, 12, 6, 7, 0, 0, 1, tzinfo=timezone(timedelta(hours=2))),
            capture_id="c-3",
        ),
        CompletionRecord(run_id="r-2", policy="p", request={"a": [None, True, False, {}]}, capture_id="c-4"),
    ]


@asynccontextmanager
async def _writer_conn(path: Path):
    """The writer's connection to a fresh SQLite file of the current schema."""
    url = f"sqlite:///{path}"
    await db.upgrade_async(url)
    engine = db.create_engine(url)
    conn = await db.connect_write(db.writer_engine(engine))
    try:
        yield conn
    finally:
        await conn.close()
        await engine.dispose()


async def _write(path: Path, fast: bool) -> None:
    async with _writer_conn(path) as conn:
        async with conn.begin():
            recs = records()
            first = await ensure_runs(conn, recs)
            if fast:
                assert await insert_completions(conn, recs, first, NOW) == len(recs)
            else:  # SQLAlchemy's executemany of the same statement with parameter dicts
                seq = dict(first)
                rows = []
                for r in recs:
                    row = {f: getattr(r, f) for f in COMPLETION_FIELDS}
                    row["created_at"] = r.created_at or NOW
                    row["seq"] = seq[r.run_id] if r.run_id else None
                    if r.run_id:
                        seq[r.run_id] += 1
                    rows.append(row)
                await conn.execute(_INSERT_COMPLETIONS, rows)


def _rows(path: Path, table: str = "completions") -> list[tuple]:
    """Every row of `table`, each column with its storage class."""
    con = sqlite3.connect(path)
    try:
        cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
        select = ", ".join(f"{c}, typeof({c})" for c in cols)
        return con.execute(f"SELECT {select} FROM {table} ORDER BY id").fetchall()
    finally:
        con.close()


def test_the_sqlite_insert_stores_what_sqlalchemy_stores(tmp_path: Path) -> None:
    asyncio.run(_write(tmp_path / "fast.db", fast=True))
    asyncio.run(_write(tmp_path / "reference.db", fast=False))
    fast, reference = _rows(tmp_path / "fast.db"), _rows(tmp_path / "reference.db")
    assert len(fast) == 4
    assert fast == reference
    # and what the values are (the JSON text as orjson writes it; -inf and NaN as null; seq per run)
    con = sqlite3.connect(tmp_path / "fast.db")
    assert con.execute("SELECT run_id, seq, stream FROM completions ORDER BY id").fetchall() == [
        ("r-1", 0, 1),
        (None, None, 0),
        ("r-1", 1, None),
        ("r-2", 0, None),
    ]
    assert con.execute("SELECT logprobs, created_at FROM completions WHERE id = 1").fetchone() == (
        "[[-0.25,null,null],[]]",
        "2026-12-06 04:59:59.000000",
    )
    assert con.execute("SELECT created_at FROM completions WHERE id = 2").fetchone() == (
        "2026-12-06 05:00:00.123456",
    )
    con.close()


class _NoDriver:
    """The writer's connection without `driver`: `apply_reward` takes SQLAlchemy's path."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.dialect = conn.dialect

    async def execute(self, *args):
        return await self.conn.execute(*args)


async def _rewards(path: Path, fast: bool) -> list:
    outcomes = []
    async with _writer_conn(path) as conn:
        assert hasattr(conn, "driver")  # the writer's SQLite connection: the driver's path is taken
        async with conn.begin():
            recs = records()
            recs[3].request = {"messages": [{"role": "user", "content": "x"}]}
            recs += [
                CompletionRecord(run_id=f"r-{i}", policy="p", group_id="g", capture_id=f"x-{i}")
                for i in (3, 4, 5, 6)
            ]
            for r in recs:  # the runs' created_at from the records: both files alike
                r.created_at = r.created_at or NOW
            first = await ensure_runs(conn, recs)
            await insert_completions(conn, recs, first, NOW)
        calls = [
            ("r-1", 0.5, {"acc": 1.0, "why": "é \u2028"}, {"k": [1, None]}, None, None),
            ("r-1", 0.5, None, None, None, None),  # the same again: False
            ("r-1", 0.75, None, None, None, None),  # another number: a conflict
            ("r-2", None, None, None, "rubric ☃", None),  # the judge's, with a rubric
            ("r-2", None, None, None, "rubric ☃", None),  # asked again: False
            ("r-3", 1e-7, {}, None, None, "val"),  # a validation run
            ("r-4", None, None, None, "one", None),  # the judge's for group g
            ("r-5", None, None, None, "two", None),  # another rubric in group g: a conflict
            ("r-6", -2.0, None, {"deep": {"a": [{"b": None}]}}, None, "train"),
            ("r-4", 0.9, None, None, None, None),  # the app's number, after the judge scored the run
            ("r-4", 0.1, None, None, None, None),  # another number: a conflict
            ("nope", 1.0, None, None, None, None),  # no such run
        ]
        for run_id, reward, metrics, metadata, rubric, split in calls:
            if (run_id, reward) == ("r-4", 0.9):  # what a judge=always scoring leaves (trainer/judge.py)
                async with conn.begin():
                    await conn.exec_driver_sql(
                        "UPDATE runs SET reward = 0.25, metrics = '{\"app_reward\": 0.9}' WHERE id = 'r-4'"
                    )
            async with conn.begin():
                used = conn if fast else _NoDriver(conn)
                out = await apply_reward(used, run_id, reward, metrics, metadata, NOW, rubric, split)
            outcomes.append(out if isinstance(out, bool) else (type(out).__name__, str(out)))
    return outcomes


def test_a_reward_on_sqlites_driver_stores_what_sqlalchemy_stores(tmp_path: Path) -> None:
    """`apply_reward` on the writer's SQLite connection runs its two statements on the driver itself
    (`rows._Lite`): the same outcomes, and the runs table the same byte for byte, as through SQLAlchemy."""
    fast = asyncio.run(_rewards(tmp_path / "fast.db", fast=True))
    reference = asyncio.run(_rewards(tmp_path / "reference.db", fast=False))
    assert fast == reference
    assert fast[:3] == [True, False, ("RewardConflict", fast[2][1])]
    assert fast[-1][0] == "RunNotFound"
    assert fast[3:8] == [True, False, True, True, ("RubricConflict", fast[7][1])]
    assert fast[8] is True
    assert fast[9:11] == [False, ("RewardConflict", fast[10][1])]
    assert _rows(tmp_path / "fast.db", "runs") == _rows(tmp_path / "reference.db", "runs")
    con = sqlite3.connect(tmp_path / "fast.db")
    assert con.execute(
        "SELECT reward, status, metrics, completed_at FROM runs WHERE id = 'r-1'"
    ).fetchone() == (
        0.5,
        "completed",
        '{"acc":1.0,"why":"é \u2028"}',
        "2026-12-06 05:00:00.123456",
    )
    con.close()


def test_the_sqlite_binds_skip_the_processors_wrappers() -> None:
    """JSON values go to the engine's serializer itself and datetimes to `isoformat` (what keeps
    the rows cheap); each was checked against SQLAlchemy's processor on `rows._SAMPLES`."""
    from rlproxy.storage import rows

    engine = db.create_engine("sqlite:///:memory:")
    lite = rows._sqlite_insert(engine.dialect)[0]
    convert = {lite.names[i]: f for i, f in lite.convert}
    assert convert["request"] is engine.dialect._json_serializer
    assert convert["logprobs"] is engine.dialect._json_serializer
    at = NOW.astimezone(timezone(timedelta(hours=-7)))
    assert convert["created_at"](at) == "2026-12-05 22:00:00.123456"  # the zone's fields, as SQLAlchemy
    assert convert["created_at"](datetime(2026, 1, 2).date()) == "2026-01-02 00:00:00.000000"


def test_a_driver_error_is_raised_as_sqlalchemys(tmp_path: Path) -> None:
    """The writer's retry rules read SQLAlchemy's exception classes: `driver` raises those too."""
    from sqlalchemy import exc

    async def go() -> None:
        async with _writer_conn(tmp_path / "s.db") as conn, conn.begin():
            try:
                conn.driver("SELECT no_such_column FROM runs", ())
            except exc.OperationalError as e:
                assert "no_such_column" in str(e.orig)
            else:
                raise AssertionError("no error")

    asyncio.run(go())
