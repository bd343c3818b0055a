"""`rlproxy import` on each store (SQLite and PostgreSQL): stored once, a malformed line skipped, the
imported calls read back by what uses them (SFT's selection, the siblings' `imported` mode).

The records are stored-completions pairs of a real `openai` client's calls against the stub upstream
(tests/trainer/test_siblings_imported.py makes them), plus one line that is not JSON.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sqlalchemy import text
from trainer.test_siblings_imported import _chat_records
from typer.testing import CliRunner

from rlproxy.cli.main import app
from rlproxy.storage import siblings as store
from rlproxy.storage.db import create_engine
from rlproxy.storage.export import select_run_ids
from rlproxy.trainer.offline import sft_condition


def _import(path: Path, url: str, *args: str) -> str:
    out = CliRunner().invoke(app, ["import", str(path), "--db", url, *args])
    assert out.exit_code == 0, out.output
    return out.stdout.strip().splitlines()[-1]


async def test_import_is_stored_once_and_read_back(stub: Any, any_db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    requests = _chat_records(stub, path, "pg")
    path.write_text(path.read_text() + "{not json\n")

    first = await asyncio.to_thread(_import, path, any_db_url, "--policy", "agent")
    assert first == "imported 2 call(s) in 2 new run(s), 0 scored; 0 already there; 1 malformed"
    again = await asyncio.to_thread(_import, path, any_db_url, "--policy", "agent")
    assert again == "imported 0 call(s) in 0 new run(s), 0 scored; 2 already there; 1 malformed"

    engine = create_engine(any_db_url)
    try:
        async with engine.connect() as conn:
            got = (
                await conn.execute(
                    text(
                        "SELECT r.status, r.status_reason, c.source, c.policy, c.adapter, c.prompt_token_ids "
                        "FROM runs r JOIN completions c ON c.run_id = r.id ORDER BY c.id"
                    )
                )
            ).all()
        want = ("skipped", "imported", "import", "agent", "gpt-4o-mini", None)
        assert [tuple(r) for r in got] == [want, want]
        ids = await select_run_ids(engine, *sft_condition(None, None, None, False, from_source="import"))
        assert len(ids) == 2
        calls, _ = await store.imported_calls(engine, after=0)
        assert [c.request["messages"] for c in calls] == [r["messages"] for r in requests]
        assert all(c.policy == "agent" and c.reason == "imported" and not c.prompt_ids for c in calls)
    finally:
        await engine.dispose()
