"""Our traffic as OpenTelemetry GenAI spans (issue 58, item 3): live to an OTLP receiver that decodes
the protobuf with opentelemetry-proto's own classes, and by `rlproxy export --format otlp`.

The calls are the real openai SDK's, through a real proxy (uvicorn, loopback) in front of the stub
upstream (tests/stub_upstream.py)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from typer.testing import CliRunner

from rlproxy.cli import main
from rlproxy.settings import TracesSettings
from rlproxy.traces import otlp_file
from rlproxy.traces.otlp_live import OtlpExporter, parse_headers, traces_url
from rlproxy.traces.otlp_spans import REWARD_SPAN, call_span, json_line

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _attrs(span: Any) -> dict[str, Any]:
    """A span's attributes (a decoded Span, or `call_span`'s fields) as plain values (arrays as lists)."""
    out = {}
    for kv in (Span(**span) if isinstance(span, dict) else span).attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
            if kind == "array_value"
            else getattr(v, kind)
        )
    return out


def _wait(cond: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def _metric(proxy: Any, name: str) -> float:
    for line in httpx.get(f"{proxy.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


def _chat(proxy: Any, run_id: str, **kwargs: Any) -> Any:
    client = openai.OpenAI(
        base_url=f"{proxy.url}/v1", api_key="x", max_retries=0, default_headers={"X-Run-Id": run_id}
    )
    return client.chat.completions.create(model="stub-model", messages=MESSAGES, **kwargs)


def test_live_spans_of_an_sdk_call_and_its_reward(make_proxy, stub, receiver, tmp_path):
    proxy = make_proxy(
        stub.url,
        otlp_endpoint=receiver.url,
        otlp_headers="Authorization=Basic%20abc",
        otlp_interval=0.05,
        otlp_capture_content=True,
    )
    got = _chat(proxy, "ep-1", temperature=0.7, max_tokens=8, tools=TOOLS)
    assert httpx.post(f"{proxy.url}/v1/runs/ep-1/reward", json={"reward": 0.5}).status_code == 200
    _wait(lambda: len(receiver.spans) == 2)
    assert receiver.paths == ["/v1/traces"] * len(receiver.paths)
    assert receiver.headers[0]["Authorization"] == "Basic abc"
    call, reward = sorted(receiver.spans, key=lambda s: s.name == REWARD_SPAN)
    run_trace = hashlib.sha256(b"rlproxy-run:ep-1").digest()[:16]
    assert call.trace_id == reward.trace_id == run_trace  # the run is one trace
    a = _attrs(call)
    assert call.name == "chat stub-model" and call.end_time_unix_nano > call.start_time_unix_nano
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "stub-model" and a["gen_ai.response.model"] == got.model
    assert a["gen_ai.response.id"] == got.id
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        got.usage.prompt_tokens,
        got.usage.completion_tokens,
    )
    assert a["gen_ai.response.finish_reasons"] == [got.choices[0].finish_reason]
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.max_tokens"]) == (0.7, 8)
    assert (a["rlproxy.run_id"], a["rlproxy.policy_step"], a["rlproxy.adapter"]) == ("ep-1", 0, "stub-model")
    group = proxy.query("SELECT group_id FROM runs WHERE id = 'ep-1'")[0][0]
    assert a["rlproxy.group_id"] == group
    inputs = json.loads(a["gen_ai.input.messages"])
    assert inputs[1] == {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]}
    output = json.loads(a["gen_ai.output.messages"])[0]
    assert output["parts"][0]["content"] == got.choices[0].message.content
    assert json.loads(a["gen_ai.tool.definitions"]) == TOOLS
    assert _attrs(reward) == {"rlproxy.run_id": "ep-1", "rlproxy.reward": 0.5, "rlproxy.reward_source": "app"}
    _wait(lambda: _metric(proxy, "rlproxy_otlp_spans_exported_total") == 2)
    assert _metric(proxy, "rlproxy_otlp_spans_dropped_total") == 0

    # the command writes the same call span (same ids and attributes) with the run's reward
    proxy.stop()
    live = call
    for fmt in ("otlp", "otlp-proto"):
        out = tmp_path / f"runs.{fmt}"
        args = ["export", "--format", fmt, "--out", str(out), "--db", str(proxy.db_path), "--content"]
        result = CliRunner().invoke(main.app, args)
        assert result.exit_code == 0, result.output
        if fmt == "otlp-proto":
            (request,) = otlp_file.read_proto(out)
            spans = list(request.resource_spans[0].scope_spans[0].spans)
            assert [s.name for s in spans] == [live.name, REWARD_SPAN]
            assert spans[0] == live
            assert _attrs(spans[1])["rlproxy.reward"] == 0.5
            assert _attrs(spans[1])["rlproxy.run_status"] == "completed"
            assert out.with_suffix(".otlp").read_bytes() == json_line(request)  # one request per line
    line = json.loads((tmp_path / "runs.otlp").read_text())
    span = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == run_trace.hex() and span["kind"] == 3  # hex ids, enums as integers


def test_a_stuck_endpoint_never_holds_a_request(make_proxy, stub, receiver, tmp_path):
    receiver.gate.clear()  # the endpoint takes the first batch and does not answer
    proxy = make_proxy(
        stub.url,
        otlp_endpoint=receiver.url,
        otlp_interval=0.01,
        otlp_batch_size=1,
        otlp_queue_max=2,
        otlp_timeout=60,
    )
    _chat(proxy, "stuck-0")
    _wait(lambda: _metric(proxy, "rlproxy_otlp_queue") == 0)  # its span is in flight, held
    for i in range(1, 6):  # answered while the export hangs: two spans queue, three are dropped
        _chat(proxy, f"stuck-{i}")
    assert _metric(proxy, "rlproxy_otlp_spans_dropped_total") == 3
    assert proxy.query("SELECT count(*) FROM completions")[0][0] == 6  # every call stored
    receiver.gate.set()
    _wait(lambda: _metric(proxy, "rlproxy_otlp_spans_exported_total") == 3)

    # every call is in the store, so the command writes the spans the live export dropped
    proxy.stop()
    out = tmp_path / "runs.otlp.bin"
    args = ["export", "--format", "otlp-proto", "--out", str(out), "--db", str(proxy.db_path)]
    assert CliRunner().invoke(main.app, args).exit_code == 0
    runs = [
        _attrs(r.resource_spans[0].scope_spans[0].spans[0])["rlproxy.run_id"]
        for r in otlp_file.read_proto(out)
    ]
    assert runs == [f"stuck-{i}" for i in range(6)]  # one length-delimited request per run, oldest first


def test_dead_endpoint_counts_failed_spans(loop_thread, stub):
    from support import free_port

    from rlproxy.storage.records import CompletionRecord

    exporter = OtlpExporter(
        TracesSettings(otlp_endpoint=f"http://127.0.0.1:{free_port()}", otlp_interval=0.01)
    )

    async def go() -> None:
        await exporter.start()
        for i in range(3):
            exporter.offer(CompletionRecord(run_id=f"r{i}", capture_id=str(i), request={"model": "m"}))
        await exporter.stop()  # sends what is queued: refused, counted

    loop_thread.run(go())
    assert (exporter.exported, exporter.failed, exporter.dropped) == (0, 3, 0)


def test_content_is_off_by_default_and_settings_parse():
    call = {"run_id": "r", "capture_id": "c", "request": {"model": "m", "messages": MESSAGES}, "status": "ok"}
    assert not any(k.startswith("gen_ai.input") for k in _attrs(call_span(call)))
    assert "gen_ai.input.messages" in _attrs(call_span(call, content=True))
    failed = _attrs(call_span({**call, "status": "error", "status_code": 502}))
    assert failed["error.type"] == "502"
    assert (
        traces_url("https://cloud.langfuse.com/api/public/otel/")
        == "https://cloud.langfuse.com/api/public/otel/v1/traces"
    )
    assert traces_url("http://localhost:6006/v1/traces") == "http://localhost:6006/v1/traces"
    assert parse_headers("Authorization=Basic%20a2V5==, x-team = one") == {
        "Authorization": "Basic a2V5==",
        "x-team": "one",
    }


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_content_flag_is_for_otlp_only(fmt, tmp_path):
    args = ["export", "--format", fmt, "--out", str(tmp_path / "x"), "--content"]
    result = CliRunner().invoke(main.app, args)
    assert result.exit_code != 0 and "--content" in result.output
