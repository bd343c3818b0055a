"""Issue 22 case 4: one record the store cannot hold never fails or delays another's batch.

The writer on SQLite and PostgreSQL (the `engine` fixture), fed records as the proxy submits them.
The edge refuses such text (proxy/validate.py); this is the writer's own guarantee for what comes
from elsewhere (an upstream's answer). Before issue 22 a non-transient failure was retried three
times with back-off before the batch was split, and each record again before it was dropped.
"""

from __future__ import annotations

import time

from sqlalchemy.ext.asyncio import AsyncEngine
from storage.test_writer import rec, rows

from rlproxy.storage.writer import Writer


async def test_case4_bad_record_is_set_apart_at_once(engine: AsyncEngine) -> None:
    w = Writer(engine, flush_interval=0.05)
    await w.start()
    # a lone surrogate: no store can hold it (it cannot be serialized). (U+0000 is stored by
    # PostgreSQL's json columns and breaks their reads later: the edge refuses it, validate.py)
    bad = ["\ud800", "x\udfff"]
    t0 = time.monotonic()
    for i, text in enumerate(bad):
        w.submit(rec("good-a", 2 * i))
        poisoned = rec("bad", 2 * i + 1)
        poisoned.request = {"messages": [{"role": "user", "content": text}]}
        w.submit(poisoned)
    w.submit(rec("good-b", 9))
    assert await w.reward("good-b", 0.5) is True  # another tenant's reward, in the same batches
    await w.flush()
    elapsed = time.monotonic() - t0
    await w.close()
    got = await rows(engine, "SELECT run_id, count(*) FROM completions GROUP BY run_id ORDER BY run_id")
    # the others' rows all there; the bad ones kept as error rows (storage/records.py `storable`)
    assert got == [("bad", len(bad)), ("good-a", len(bad)), ("good-b", 1)]
    errors = await rows(engine, "SELECT error FROM completions WHERE run_id = 'bad'")
    assert all(e for (e,) in errors), errors
    assert w.dropped == 0
    # at most: each bad batch fails once and is split; each bad record alone fails once
    assert w.write_errors <= 2 * len(bad), w.write_errors
    assert elapsed < 2.0, f"the bad record held the writer up for {elapsed:.2f} s"
