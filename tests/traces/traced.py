"""Trace files made by the real libraries (issue 58's acceptance: no hand-written test data).

A real `openai` client, instrumented by `opentelemetry-instrumentation-openai-v2`, by OpenLLMetry's
`opentelemetry-instrumentation-openai` or by `openinference-instrumentation-openai`, calls the stub
upstream (tests/stub_upstream.py) with `MESSAGES` and `TOOLS`; the OTel SDK's InMemorySpanExporter
keeps the spans, and `opentelemetry-exporter-otlp-proto-common`'s encoder makes the OTLP request
written as OTLP protobuf (one message, or length-delimited) or as JSON (protobuf's `json_format`,
one request a line).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "a city's weather", "parameters": CITY},
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
MESSAGES = [  # a conversation with a tool call and its result: what the client sends
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def traced_spans(kind: str, base_url: str, monkeypatch: pytest.MonkeyPatch, calls: int = 1) -> list[Any]:
    """The finished spans of `calls` chat calls of an openai client instrumented by `kind`
    (openai-v2: content on the span, as 2.4b0 writes it with gen_ai_latest_experimental; openllmetry;
    openinference)."""
    import openai
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    if kind == "openai-v2":
        monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")
        monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
    elif kind == "openllmetry":  # Traceloop's opentelemetry-instrumentation-openai
        from opentelemetry.instrumentation.openai import OpenAIInstrumentor
    else:
        from openinference.instrumentation.openai import OpenAIInstrumentor
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-test")
        tracer = provider.get_tracer("test")
        for i in range(calls):
            with tracer.start_as_current_span(f"episode {i}"):  # one trace per episode
                client.chat.completions.create(
                    model="stub-model", messages=MESSAGES, tools=TOOLS, temperature=0.5
                )
    finally:
        instrumentor.uninstrument()
    return list(exporter.get_finished_spans())


def write_otlp(spans: list[Any], path: Path, encoding: str) -> Path:
    """`spans` as an OTLP file: json (one ExportTraceServiceRequest a line), proto (one message),
    or proto-delimited (each request after its varint length)."""
    from google.protobuf import json_format
    from google.protobuf.internal.encoder import _VarintBytes
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    requests = [encode_spans([s]) for s in spans] if encoding != "proto" else [encode_spans(spans)]
    if encoding == "json":
        path.write_text("".join(json.dumps(json_format.MessageToDict(r)) + "\n" for r in requests))
    elif encoding == "proto":
        path.write_bytes(requests[0].SerializeToString())
    else:
        path.write_bytes(b"".join(_VarintBytes(r.ByteSize()) + r.SerializeToString() for r in requests))
    return path
