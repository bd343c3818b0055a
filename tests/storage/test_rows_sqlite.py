"""The SQLite store's completions INSERT (`rows.insert_completions`): the writer binds the values
itself, with SQLAlchemy's own bind processors, instead of SQLAlchemy's per-row parameter handling
(issue 24: a quarter of the writer process's CPU). Here the same records go through both, into two
real SQLite files of the current schema, and every column must come out the same: value and storage
class (`typeof`), byte for byte."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

from rlproxy.storage import db
from rlproxy.storage.records import COMPLETION_FIELDS, CompletionRecord
from rlproxy.storage.rows import _INSERT_COMPLETIONS, ensure_runs, insert_completions

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


async def _write(path: Path, fast: bool) -> None:
    url = f"sqlite:///{path}"
    await db.upgrade_async(url)
    engine = db.create_engine(url)
    conn = await db.connect_write(db.writer_engine(engine))
    try:
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
    finally:
        await conn.close()
        await engine.dispose()


def _rows(path: Path) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        cols = [r[1] for r in con.execute("PRAGMA table_info(completions)")]
        select = ", ".join(f"{c}, typeof({c})" for c in cols)
        return con.execute(f"SELECT {select} FROM completions ORDER BY id").fetchall()
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
