"""`rlproxy import` of large OTLP files: time and peak RSS for two sizes (issue 58's acceptance).

    .venv/bin/python bench/import.py                      # 10,000 and 100,000 spans
    .venv/bin/python bench/import.py --sizes 2000 20000   # a quick look

The file is synthetic but SDK-shaped: the OTel SDK itself makes every span (a tracer of a real
TracerProvider, the attributes `opentelemetry-instrumentation-openai-v2` 2.4b0 writes with content
on the span: `gen_ai.input.messages`, `gen_ai.output.messages`, model, usage, finish reasons), one
trace per episode of 4 chat calls, and `opentelemetry-exporter-otlp-proto-common`'s encoder turns
each batch of 100 spans into one ExportTraceServiceRequest written as a JSON line, as the
collector's file exporter writes them. Each size is imported by a fresh `rlproxy import` process
into a fresh SQLite store; the process reports its own peak RSS. The goal: peak RSS the same for
both sizes (memory bounded whatever the file size), time linear in the spans.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALLS_PER_TRACE = 4
SPANS_PER_LINE = 100

# Runs in the child: the import, then the process's peak RSS (KiB on Linux) as the last line.
CHILD = """
import resource, sys
from rlproxy.cli.main import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_spans(path: Path, n: int) -> None:
    """`n` GenAI chat spans made by the OTel SDK, as OTLP/JSON lines of SPANS_PER_LINE spans."""
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import set_span_in_context

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("opentelemetry.instrumentation.openai_v2")
    with path.open("w") as f:
        for i in range(n):
            if i % CALLS_PER_TRACE == 0:
                root = tracer.start_span("episode")
            ctx = set_span_in_context(root)
            question = f"task {i // CALLS_PER_TRACE}: what is {i} + {i}? " + "context " * 40
            span = tracer.start_span("chat stub-model", context=ctx)
            span.set_attributes(
                {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.provider.name": "openai",
                    "gen_ai.request.model": "stub-model",
                    "gen_ai.request.temperature": 0.7,
                    "gen_ai.response.model": "stub-model",
                    "gen_ai.response.id": f"chatcmpl-{i}",
                    "gen_ai.response.finish_reasons": ["stop"],
                    "gen_ai.usage.input_tokens": 60,
                    "gen_ai.usage.output_tokens": 12,
                    "gen_ai.input.messages": json.dumps(
                        [
                            {"role": "system", "parts": [{"type": "text", "content": "You add numbers."}]},
                            {"role": "user", "parts": [{"type": "text", "content": question}]},
                        ]
                    ),
                    "gen_ai.output.messages": json.dumps(
                        [{"role": "assistant", "parts": [{"type": "text", "content": str(2 * i)}],
                          "finish_reason": "stop"}]
                    ),
                }
            )  # fmt: skip
            span.end()
            if i % CALLS_PER_TRACE == CALLS_PER_TRACE - 1 or i == n - 1:
                root.end()
            spans = [s for s in exporter.get_finished_spans() if s.name != "episode"]
            if len(spans) >= SPANS_PER_LINE or i == n - 1:
                f.write(json.dumps(json_format.MessageToDict(encode_spans(spans))) + "\n")
                exporter.clear()


def measure(path: Path, folder: Path) -> tuple[float, int, str]:
    """(seconds, peak RSS in MiB, the summary line) of one `rlproxy import` of `path` into a new store."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    db = folder / f"{path.stem}.db"
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "import", str(path), "--db", str(db)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    lines = out.stdout.strip().splitlines()
    return seconds, int(lines[-1].split()[1]) // 1024, lines[-2] if len(lines) > 1 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs=2, default=[10_000, 100_000], metavar="N")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        results = []
        for n in args.sizes:
            path = folder / f"spans-{n}.jsonl"
            t0 = time.perf_counter()
            write_spans(path, n)
            made = time.perf_counter() - t0
            seconds, rss, summary = measure(path, folder)
            mib = path.stat().st_size / 2**20
            results.append((n, rss))
            print(
                f"{n:>8} spans  {mib:8.1f} MiB file (made in {made:.1f} s)  import {seconds:7.1f} s "
                f"({n / seconds:,.0f} spans/s)  peak RSS {rss} MiB   [{summary}]"
            )
        (n1, r1), (n2, r2) = results
        print(f"peak RSS {r2 / r1:.2f}x for {n2 / n1:.0f}x the spans (goal: about 1x)")


if __name__ == "__main__":
    main()
