"""The `messages` and `trajectories` views, on a hand-filled database, in SQL and in sqlite3."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from storage_sample import CALL_A, CALL_C1, CALL_C2, PARTS, SYS, USER_PARIS, fill_sample
from support import require

from rlproxy.storage.db import create_engine, sqlite_path, upgrade


def j(v: Any) -> Any:
    """A JSON value as Python, whether the driver gave text (SQLite, json) or decoded it."""
    return json.loads(v) if isinstance(v, str) else v


async def fetch(engine: AsyncEngine, sql: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        return [dict(r._mapping) for r in (await conn.execute(text(sql))).all()]


async def test_messages_view(sample_engine: AsyncEngine) -> None:
    rows = await fetch(
        sample_engine,
        "SELECT m.*, c.run_id AS r FROM messages m JOIN completions c ON c.id = m.completion_id "
        "ORDER BY m.completion_id, m.idx",
    )
    assert set(rows[0]) >= {"run_id", "completion_id", "seq", "idx", "role", "content", "tool_calls", "name"}
    by_run: dict[Any, list[dict]] = {}
    for r in rows:
        by_run.setdefault((r["run_id"], r["seq"]), []).append(r)

    a1 = by_run[("a", 1)]
    assert [(m["idx"], m["role"]) for m in a1] == [
        (0, "system"),
        (1, "user"),
        (2, "assistant"),
        (3, "tool"),
        (4, "assistant"),  # the reply, after the k request messages
    ]
    assert a1[0]["content"] == SYS["content"] and a1[1]["content"] == USER_PARIS["content"]
    assert a1[2]["content"] is None and j(a1[2]["tool_calls"]) == [CALL_A]
    assert a1[3]["name"] == "get_weather" and a1[3]["content"] == "sunny" and a1[3]["tool_calls"] is None
    assert a1[4]["content"] == "It is sunny in Paris."

    a0 = by_run[("a", 0)]  # a reply that only calls a tool
    assert [(m["idx"], m["role"]) for m in a0] == [(0, "system"), (1, "user"), (2, "assistant")]
    assert j(a0[2]["tool_calls"]) == [CALL_A]

    c1 = by_run[("c", 1)]  # the upstream failed: request messages only, no reply row
    assert [m["role"] for m in c1] == ["user", "assistant", "tool", "tool"]
    assert j(c1[1]["tool_calls"]) == [CALL_C1, CALL_C2]

    (d_user, d_reply) = by_run[("d", 0)]  # content as a list of parts: its JSON text
    assert j(d_user["content"]) == PARTS and d_reply["content"] == "A picture."

    assert ("f", 0) not in by_run  # the completions endpoint has no messages
    assert [m["content"] for m in by_run[(None, None)]] == ["no run key"]  # unkeyed calls are there too
    assert all(r["run_id"] == r["r"] for r in rows)
    assert len(rows) == 5 + 3 + 2 + 2 + 4 + 2 + 2 + 1


async def test_trajectories_view(sample_engine: AsyncEngine) -> None:
    rows = {r["run_id"]: r for r in await fetch(sample_engine, "SELECT * FROM trajectories")}
    assert set(rows) == {"a", "b", "c", "d", "e", "f"}
    assert set(rows["a"]) == {"run_id", "group_id", "reward", "status", "n_completions", "messages"}
    a = rows["a"]
    assert (a["group_id"], a["reward"], a["status"], a["n_completions"]) == ("g1", 1.0, "trained", 2)
    msgs = j(a["messages"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[-1] == {"role": "assistant", "content": "It is sunny in Paris."}
    assert msgs[2]["tool_calls"] == [CALL_A]
    assert len(j(rows["c"]["messages"])) == 4  # the last call failed: no reply to append
    assert j(rows["d"]["messages"])[0]["content"] == PARTS
    assert j(rows["f"]["messages"]) == []  # a completions-endpoint run
    assert rows["f"]["reward"] is None and rows["f"]["status"] == "open"
    assert {r: rows[r]["n_completions"] for r in rows} == {"a": 2, "b": 1, "c": 2, "d": 1, "e": 1, "f": 1}


async def test_sqlite3_command_line_reads_the_views(db_url: str) -> None:
    """`sqlite3 rlproxy.db "SELECT * FROM trajectories"` must just work (Debian's sqlite3 package)."""
    exe = shutil.which("sqlite3")
    require(exe, "the sqlite3 command line is missing (root: apt-get install sqlite3)")
    upgrade(db_url)
    eng = create_engine(db_url)
    await fill_sample(eng)
    await eng.dispose()
    db = sqlite_path(db_url)
    out = subprocess.run(
        [exe, "-json", db, "SELECT * FROM trajectories ORDER BY run_id"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = json.loads(out)
    assert [r["run_id"] for r in rows] == ["a", "b", "c", "d", "e", "f"]
    assert json.loads(rows[0]["messages"])[-1]["content"] == "It is sunny in Paris."
    out = subprocess.run(
        [exe, db, "SELECT count(*) FROM messages"], capture_output=True, text=True, check=True
    ).stdout
    assert int(out) == 21
