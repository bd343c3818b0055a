"""The five "Query your trajectories" queries of the README, each run on the sample database.

The README shows them for `sqlite3 rlproxy.db`; the ones in PORTABLE also run unchanged on
PostgreSQL (the others use SQLite's json_each/json_array_length; PostgreSQL has jsonb equivalents).
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

MEAN_REWARD_PER_STEP = """
-- Mean reward per policy step: is training helping? (the step that served each run's first call)
SELECT c.policy_step, count(*) AS runs, avg(r.reward) AS mean_reward
FROM runs AS r JOIN completions AS c ON c.run_id = r.id AND c.seq = 0
WHERE r.reward IS NOT NULL
GROUP BY c.policy_step
ORDER BY c.policy_step;
"""

GROUP_SPREAD = """
-- Runs per group and their reward spread (a group with zero spread teaches nothing)
SELECT group_id, count(*) AS runs, min(reward) AS worst, max(reward) AS best,
       avg(reward) AS mean, max(reward) - min(reward) AS spread
FROM runs
WHERE reward IS NOT NULL
GROUP BY group_id
ORDER BY runs DESC, group_id;
"""

LONGEST_TRAJECTORIES = """
-- The longest trajectories: messages in the final conversation, model calls, reward
SELECT run_id, json_array_length(messages) AS n_messages, n_completions, reward, status
FROM trajectories
ORDER BY n_messages DESC, run_id
LIMIT 5;
"""

TOOLS_CALLED = """
-- Which tools the agent called, how often, and in how many runs
SELECT json_extract(call.value, '$.function.name') AS tool,
       count(*) AS calls, count(DISTINCT c.run_id) AS runs
FROM completions AS c, json_each(c.response, '$.choices[0].message.tool_calls') AS call
GROUP BY tool
ORDER BY calls DESC, tool;
"""

FAILED_REQUESTS = """
-- Failed upstream requests, newest first
SELECT created_at, run_id, status_code, error, latency_ms
FROM completions
WHERE status_code >= 400 OR error IS NOT NULL
ORDER BY created_at DESC
LIMIT 20;
"""

QUERIES = {
    "Mean reward per policy step": MEAN_REWARD_PER_STEP,
    "Runs per group and their reward spread": GROUP_SPREAD,
    "The longest trajectories": LONGEST_TRAJECTORIES,
    "Which tools the agent called": TOOLS_CALLED,
    "Failed upstream requests": FAILED_REQUESTS,
}
PORTABLE = {MEAN_REWARD_PER_STEP, GROUP_SPREAD, FAILED_REQUESTS}

EXPECTED: dict[str, list[tuple]] = {
    MEAN_REWARD_PER_STEP: [(0, 3, 0.5), (1, 2, 1.0)],
    GROUP_SPREAD: [("g1", 3, 0.0, 1.0, 0.5, 1.0), ("g2", 2, 1.0, 1.0, 1.0, 0.0)],
    LONGEST_TRAJECTORIES: [
        ("a", 5, 2, 1.0, "trained"),
        ("c", 4, 2, 0.5, "trained"),
        ("b", 2, 1, 0.0, "trained"),
        ("d", 2, 1, 1.0, "completed"),
        ("e", 2, 1, 1.0, "completed"),
    ],
    TOOLS_CALLED: [("get_weather", 3, 3), ("search", 1, 1)],
    FAILED_REQUESTS: [(None, 504, "upstream timed out"), ("c", 502, "upstream refused the connection")],
}


def _norm(sql: str, row: tuple) -> tuple:
    if sql is FAILED_REQUESTS:  # times differ in type between drivers: check the rest
        return tuple(row[1:4])
    return tuple(float(v) if isinstance(v, float) or type(v).__name__ == "Decimal" else v for v in row)


# Every query on SQLite; the PORTABLE ones on PostgreSQL too (the others use SQLite's JSON functions).
CASES = [("sqlite", t) for t in QUERIES] + [("postgresql", t) for t in QUERIES if QUERIES[t] in PORTABLE]


@pytest.mark.parametrize(("db_kind", "title"), CASES)
async def test_readme_query(title: str, sample_engine: AsyncEngine) -> None:
    sql = QUERIES[title]
    async with sample_engine.connect() as conn:
        got = [_norm(sql, tuple(r)) for r in (await conn.exec_driver_sql(sql)).all()]
    assert got == EXPECTED[sql]


def markdown() -> str:
    """The README section (the lead pastes it; later the test reads the queries from README.md)."""
    out: list[Any] = [
        "## Query your trajectories\n",
        "Everything is in plain SQL tables and two views (`messages`, `trajectories`); the schema is in",
        "[`docs/schema.sql`](schema.sql). With the default SQLite store:\n",
    ]
    for title, sql in QUERIES.items():
        note = "" if sql in PORTABLE else " (SQLite; on PostgreSQL use the jsonb functions)"
        out.append(f"**{title}**{note}\n")
        out.append("<!-- test: sql -->\n")  # tests/test_readme.py runs it on a short real run's database
        out.append(f"```sql\n{sql.strip()}\n```\n")
    out.append('Run any of them with `sqlite3 rlproxy.db` or read-only through `rlproxy sql "SELECT ..."`.')
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
