"""`rlproxy import` of OTLP files written from real instrumented openai clients (issue 58, item 1).

Each file imports into runs a SQL query reads back: the messages the client sent, the tools where the
span holds them (OpenInference does; openai-v2 2.4b0 records no tool definitions), text only
(token ids NULL, source `import`), runs `skipped` / `imported`, the span's ids kept; a second import
stores nothing new; a malformed line is reported with its number and the rest is imported.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from traced import MESSAGES, TOOLS, traced_spans, write_otlp
from typer.testing import CliRunner

from rlproxy.cli.main import app

runner = CliRunner()


def rlproxy_import(*args: str) -> tuple[int, str, str]:
    out = runner.invoke(app, ["import", *args])
    return out.exit_code, out.stdout, out.stderr


def rows(db: Path) -> list[dict]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [
            dict(r)
            for r in conn.execute(
                "SELECT c.run_id, c.seq, c.capture_id, c.source, c.request, c.response, c.token_ids, "
                "c.prompt_token_ids, c.prompt_tokens, c.completion_tokens, r.status, r.status_reason "
                "FROM completions c JOIN runs r ON r.id = c.run_id ORDER BY c.run_id, c.seq"
            )
        ]


@pytest.mark.parametrize("encoding", ["json", "proto", "proto-delimited"])
@pytest.mark.parametrize("kind", ["openai-v2", "openllmetry", "openinference"])
def test_import_reads_back_what_the_client_sent(kind, encoding, stub, monkeypatch, tmp_path):
    spans = traced_spans(kind, stub.url, monkeypatch, calls=2)
    llm = [s for s in spans if s.name != "episode 0" and s.name != "episode 1"]
    assert len(llm) == 2
    path = write_otlp(spans, tmp_path / f"traces.{'jsonl' if encoding == 'json' else 'pb'}", encoding)
    db = tmp_path / "s.db"

    code, out, err = rlproxy_import(str(path), "--db", str(db))
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith("imported 2 call(s) in 2 new run(s)")

    got = rows(db)
    assert len(got) == 2
    for row, span in zip(got, sorted(llm, key=lambda s: f"{s.context.trace_id:032x}"), strict=True):
        trace, sid = f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"
        assert row["run_id"] == f"import:{trace}" and row["capture_id"] == f"import:{trace}:{sid}"
        request, response = json.loads(row["request"]), json.loads(row["response"])
        assert request["messages"] == MESSAGES
        assert request.get("tools") == (None if kind == "openai-v2" else TOOLS)
        assert request["model"] == "stub-model" and request["temperature"] == 0.5
        reply = response["choices"][0]["message"]
        assert reply["role"] == "assistant" and reply["content"].startswith("t100")
        assert (row["prompt_tokens"], row["completion_tokens"]) == (5, 8)
        assert row["source"] == "import" and row["token_ids"] is None and row["prompt_token_ids"] is None
        assert (row["status"], row["status_reason"]) == ("skipped", "imported")  # never a GRPO sample

    # the same file again: stored once
    code, out, _ = rlproxy_import(str(path), "--db", str(db))
    assert code == 0 and "imported 0 call(s)" in out and "2 already there" in out
    assert len(rows(db)) == 2


def test_a_malformed_line_is_reported_and_skipped(stub, monkeypatch, tmp_path):
    spans = traced_spans("openinference", stub.url, monkeypatch, calls=2)
    good = write_otlp(spans, tmp_path / "good.jsonl", "json").read_text().splitlines()
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "\n".join([good[0], '{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x"', *good[1:]]) + "\n"
    )
    db = tmp_path / "s.db"

    code, out, err = rlproxy_import(str(path), "--db", str(db))
    assert code == 0
    assert f"{path}:2:" in err  # its line number
    assert out.strip().endswith("0 already there; 1 malformed")
    assert len(rows(db)) == 2  # nothing else lost


def test_nothing_readable_is_exit_2(tmp_path):
    path = tmp_path / "junk.jsonl"
    path.write_text("not json\n")
    code, _, err = rlproxy_import(str(path), "--db", str(tmp_path / "s.db"))
    assert code == 2 and "error: nothing could be read" in err
    code, _, err = rlproxy_import(str(path), "--format", "csv", "--db", str(tmp_path / "s.db"))
    assert code == 2 and err.startswith("error:")
