"""The crash journal (issue 9, case 6 "loss on kill -9"): frames survive the process, torn tails are
ignored, live processes keep their segments, committed segments are deleted, replay stores once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import orjson
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from rlproxy.storage.journal import Journal, decode, default_folder, encode
from rlproxy.storage.records import CompletionRecord
from rlproxy.storage.writer import Writer


def rec(run_id: str | None, i: int = 0) -> CompletionRecord:
    return CompletionRecord(
        run_id=run_id,
        policy="p",
        default_group="g",
        endpoint="chat.completions",
        request={"messages": [{"role": "user", "content": f"q{i}"}], "i": i},
        response={"choices": [{"message": {"role": "assistant", "content": f"a{i}"}}]},
        token_ids=[[1, 2, i]],
        logprobs=[[-0.5, float("-inf")]],
        status="ok",
        status_code=200,
        created_at=datetime(2026, 11, 30, 12, 0, i, tzinfo=UTC),
        capture_id=f"cap-{i}",
    )


def _die(journal: Journal) -> None:
    """What a kill -9 leaves: the files, no process holding their locks."""
    for seg in list(journal._segments):
        os.close(seg.fd)
    journal._segments.clear()


def test_encode_decode_round_trip() -> None:
    r = rec("run", 3)
    back = decode(encode(r))
    assert back.created_at == r.created_at and back.request == r.request and back.token_ids == [[1, 2, 3]]
    assert back.logprobs == [[-0.5, None]]  # stored the same way: JSON has no -inf
    assert back.capture_id == "cap-3" and back.default_group == "g"


def test_a_key_that_is_not_a_string_is_written_as_one() -> None:
    """The fast path (no non-string-key option) falls back to the option, never to an error row;
    with string keys both write the same bytes."""
    r = rec("run", 4)
    r.request = {"messages": [], "logit_bias": {50256: -100}}
    assert decode(encode(r)).request == {"messages": [], "logit_bias": {"50256": -100}}
    plain = rec("run", 5)
    assert encode(plain) == orjson.dumps(plain, option=orjson.OPT_NON_STR_KEYS)


def test_records_survive_sigkill_of_the_writing_process(tmp_path: Path) -> None:
    """Appended with os.write and no fsync, then SIGKILL: the next process reads every record."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_journal import rec
        from rlproxy.storage.journal import Journal, encode
        j = Journal({str(tmp_path / "j")!r}, segment_bytes=4096)
        for i in range(50):
            j.append(encode(rec("run", i)))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    found = Journal(tmp_path / "j").recover()
    assert [r.capture_id for _seg, records in found for r in records] == [f"cap-{i}" for i in range(50)]
    assert len(found) > 1  # rotated into several segments, replayed in order


def test_a_torn_tail_is_ignored(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    for i in range(3):
        j.append(encode(rec("r", i)))
    path = j._active.path
    _die(j)
    frame = Path(path).read_bytes()
    Path(path).write_bytes(frame + frame[:40])  # died inside write(): half a frame
    ((_seg, records),) = Journal(tmp_path).recover()
    assert [r.capture_id for r in records] == ["cap-0", "cap-1", "cap-2"]


def test_segments_of_a_live_process_are_not_adopted(tmp_path: Path) -> None:
    live = Journal(tmp_path)
    live.append(encode(rec("r", 0)))
    assert Journal(tmp_path).recover() == []  # its lock is held: not ours to replay
    _die(live)
    assert len(Journal(tmp_path).recover()) == 1


def test_resolved_segments_are_deleted_and_size_is_capped(tmp_path: Path) -> None:
    j = Journal(tmp_path, max_bytes=64 * 1024, segment_bytes=4096)
    # whole segments: the active one must end up holding no resolved record (whatever a record's size)
    per_segment = -(-4096 // (len(encode(rec("r", 1))) + 8))
    segs = [j.append(encode(rec("r", i % 10))) for i in range(5 * per_segment)]
    assert len({id(s) for s in segs}) > 2 and len(list(tmp_path.glob("*.seg"))) > 2
    for s in segs:
        j.resolve(s)
    assert len(list(tmp_path.glob("*.seg"))) == 1  # only the active one is left
    kept = 0
    while j.append(encode(rec("r", 1))) is not None:
        kept += 1
    assert j.skipped == 1 and j.size <= 64 * 1024  # full: not journaled, counted
    j.close()  # a clean stop keeps the unresolved records for the next start, nothing else
    assert sum(len(records) for _seg, records in Journal(tmp_path).recover()) == kept


def test_default_folder(tmp_path: Path) -> None:
    assert default_folder(str(tmp_path / "x.db"), tmp_path) == Path(str(tmp_path / "x.db") + ".journal")
    assert default_folder("sqlite+aiosqlite://", tmp_path) is None
    pg = default_folder("postgresql://u:secret@h/db", tmp_path)
    assert pg is not None and pg.parent == tmp_path / "journal" and "secret" not in str(pg)


async def _rows(engine: AsyncEngine, sql: str) -> list[tuple]:
    async with engine.connect() as conn:
        return [tuple(r) for r in (await conn.execute(text(sql))).all()]


async def test_replay_stores_every_record_once(engine: AsyncEngine, tmp_path: Path) -> None:
    """Three records committed and two only journaled when the process dies: after replay all five
    are stored exactly once, in order, and the journal is gone."""
    j1 = Journal(tmp_path / "j")
    w1 = Writer(engine, flush_interval=0, journal=j1, thread=False)  # killed below: its task, in-loop
    await w1.start()
    for i in range(3):
        w1.submit(rec("r", i))
    await w1.flush()
    w1.runner.task.cancel()  # the writer stops committing...
    for i in range(3, 5):
        w1.submit(rec("r", i))
    _die(j1)  # ...and the process is killed
    await w1.runner.discard_conn()
    assert await _rows(engine, "SELECT count(*) FROM completions") == [(3,)]

    w2 = Writer(engine, flush_interval=0, journal=Journal(tmp_path / "j"))
    await w2.start()
    assert await w2.recover(timeout=30) == 5
    assert w2.replayed == 2 and w2.dropped == 0
    got = await _rows(engine, "SELECT seq, capture_id, request FROM completions ORDER BY seq")
    requests = [r if isinstance(r, dict) else json.loads(r) for _s, _c, r in got]
    assert [(s, c, r["i"]) for (s, c, _), r in zip(got, requests, strict=True)] == [
        (i, f"cap-{i}", i) for i in range(5)
    ]
    assert list((tmp_path / "j").glob("*.seg")) == []  # all committed: deleted
    await w2.close()


def test_a_record_of_another_version_decodes_to_the_fields_both_know() -> None:
    """A journal left by an older or newer proxy: unknown fields are dropped, missing ones default."""
    data = json.loads(encode(rec("run", 4)))
    data["a_field_from_the_future"] = 1
    del data["ttft_ms"]
    back = decode(json.dumps(data).encode())
    assert back.run_id == "run" and back.capture_id == "cap-4" and back.ttft_ms is None
