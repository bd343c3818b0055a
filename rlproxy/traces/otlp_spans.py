"""One captured call as an OpenTelemetry GenAI span, and one reward as a span of its run's trace.

The same functions serve the live export (`otlp_live.py`, from the record the writer was handed)
and the command (`otlp_file.py`, from the stored rows), so both give a call the same ids: a
backend that receives a call twice (live, then from a file) keeps it once.

A run is a trace: its trace id is the first 16 bytes of sha256("rlproxy-run:" + run id), so Phoenix
and Langfuse show an episode as one trace (an untagged call is a trace of its own, by its capture
id). A call's span id comes from its `capture_id` (the completions column). Each call is a root span
of its run's trace (a run has no span of its own: when it ends is known only at its reward).

A span per call, kind CLIENT, named "{gen_ai.operation.name} {gen_ai.request.model}", from the
request's arrival (`created_at`) to its last byte (`latency_ms`), status ERROR with the error for a
failed call. Its attributes (docs/traces_export.md lists them):

    gen_ai.*   the GenAI semantic conventions (names from `genai.py`, shared with `rlproxy
               import`): operation.name (chat | text_completion), request.model, response.model,
               response.id, the request's parameters (request.temperature, top_p, max_tokens, seed,
               frequency_penalty, presence_penalty, stop_sequences), usage.input_tokens,
               usage.output_tokens, response.finish_reasons, and error.type (the HTTP status of a
               failed call); with content capture on (the convention's opt-in): input.messages,
               output.messages (JSON, the convention's role + parts form) and tool.definitions
    rlproxy.*  ours: run_id, group_id, policy, policy_step, adapter (the model the upstream served),
               api (the completions.endpoint value), source ("hosted": a text-only upstream),
               ttft_ms

A reward arrives after the run's calls, so it is a span of its own in the run's trace, named
"rlproxy.reward", at the time it was stored (live) or the run's completed_at (the command), with
rlproxy.run_id, rlproxy.reward, rlproxy.reward_source (app | judge; live: app) and, from the
command, rlproxy.group_id and rlproxy.run_status.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from rlproxy.errors import ConfigError
from rlproxy.storage.export import json_value
from rlproxy.storage.records import Endpoint
from rlproxy.storage.times import aware
from rlproxy.traces import genai

try:
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,  # noqa: F401  (otlp_live.py reads the endpoint's answer)
    )
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
except ImportError as exc:  # the library runs without the extra; only this feature needs it
    raise ConfigError("OTLP export needs opentelemetry-proto: pip install 'rlproxy[traces]'") from exc

SERVICE_NAME = "rlproxy"  # the resource's service.name: what Phoenix and Langfuse group the traces by
REWARD_SPAN = "rlproxy.reward"
MAX_TOKENS = "gen_ai.request.max_tokens"
EPOCH, MICROSECOND = datetime(1970, 1, 1, tzinfo=UTC), timedelta(microseconds=1)


def _id(kind: str, key: str, size: int) -> bytes:
    return hashlib.sha256(f"rlproxy-{kind}:{key}".encode()).digest()[:size]


def trace_id(run_id: str) -> bytes:
    """The trace id of a run (16 bytes): the same run, the same trace, wherever it is exported from."""
    return _id("run", run_id, 16)


def _value(v: Any) -> dict[str, Any]:
    """An attribute value as AnyValue's fields (a dict builds the message ~3x faster than objects)."""
    if isinstance(v, bool):
        return {"bool_value": v}
    if isinstance(v, int):
        return {"int_value": v}
    if isinstance(v, float):
        return {"double_value": v}
    if isinstance(v, list | tuple):
        return {"array_value": {"values": [_value(x) for x in v]}}
    return {"string_value": str(v)}


def _attributes(attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in attrs.items() if v is not None]


def _ns(at: datetime | None) -> int:
    """Nanoseconds since the epoch, exactly (a float timestamp loses the last microseconds)."""
    return (aware(at) - EPOCH) // MICROSECOND * 1000 if isinstance(at, datetime) else 0


def _parts(m: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI chat message's content as the GenAI convention's parts (text, tool_call,
    tool_call_response); a part of another type (an image) as the client sent it."""
    content = m.get("content")
    if m.get("role") == "tool":
        return [{"type": genai.PART_TOOL_RESPONSE, "id": m.get("tool_call_id"), "response": content}]
    parts: list[dict[str, Any]] = []
    if isinstance(content, str) and content:
        parts.append({"type": genai.PART_TEXT, "content": content})
    elif isinstance(content, list):
        for p in content:
            is_text = isinstance(p, dict) and p.get("type") == "text"
            parts.append({"type": genai.PART_TEXT, "content": p.get("text")} if is_text else p)
    for call in m.get("tool_calls") or ():
        fn = call.get("function") or {}
        arguments = json_value(fn.get("arguments"))
        parts.append(
            {
                "type": genai.PART_TOOL_CALL,
                "id": call.get("id"),
                "name": fn.get("name"),
                "arguments": arguments,
            }
        )
    return parts


def _messages(request: Mapping[str, Any], response: Mapping[str, Any]) -> dict[str, Any]:
    """gen_ai.input.messages, gen_ai.output.messages and gen_ai.tool.definitions (JSON strings)."""
    if isinstance(request.get("messages"), list):
        inputs = [
            {"role": m.get("role"), "parts": _parts(m)} for m in request["messages"] if isinstance(m, dict)
        ]
    else:  # /v1/completions: the prompt as the user's text
        inputs = [{"role": "user", "parts": [{"type": genai.PART_TEXT, "content": request.get("prompt")}]}]
    outputs = []
    for choice in response.get("choices") or ():
        m = choice.get("message") if "message" in choice else {"content": choice.get("text")}
        outputs.append(
            {"role": "assistant", "parts": _parts(m or {}), "finish_reason": choice.get("finish_reason")}
        )
    return {
        genai.INPUT_MESSAGES: orjson.dumps(inputs).decode(),
        genai.OUTPUT_MESSAGES: orjson.dumps(outputs).decode() if outputs else None,
        genai.TOOL_DEFINITIONS: orjson.dumps(request["tools"]).decode() if request.get("tools") else None,
    }


def call_span(call: Mapping[str, Any], content: bool = False) -> dict[str, Any]:
    """The span of one call, as the `Span` fields (`export_request` adds them to its request in
    place: a built Span would be copied there): `call` holds the `completions` columns (a stored
    row, or a `CompletionRecord`'s fields) and `group_id`; `content` adds the messages (module doc)."""
    request = json_value(call.get("request"))
    request = request if isinstance(request, dict) else {}
    response = json_value(call.get("response"))
    response = response if isinstance(response, dict) else {}
    run_id, capture_id = call.get("run_id"), str(call.get("capture_id") or call.get("id"))
    operation = "text_completion" if call.get("endpoint") == Endpoint.COMPLETIONS else "chat"
    reasons = [c.get("finish_reason") for c in response.get("choices") or () if c.get("finish_reason")]
    if not reasons and call.get("finish_reason"):
        reasons = [call["finish_reason"]]
    failed = call.get("status") not in (None, "ok") or (call.get("status_code") or 200) >= 400
    attrs = {
        genai.OPERATION: operation,
        genai.REQUEST_MODEL: request.get("model"),
        genai.RESPONSE_MODEL: response.get("model") or call.get("adapter"),
        genai.RESPONSE_ID: response.get("id"),
        **{attr: request.get(key) for attr, key in genai.REQUEST_PARAMS.items()},
        genai.INPUT_TOKENS: call.get("prompt_tokens"),
        genai.OUTPUT_TOKENS: call.get("completion_tokens"),
        genai.FINISH_REASONS: reasons or None,
        "error.type": str(call.get("status_code") or call.get("status")) if failed else None,
        "rlproxy.run_id": run_id,
        "rlproxy.group_id": call.get("group_id"),
        "rlproxy.policy": call.get("policy"),
        "rlproxy.policy_step": call.get("policy_step"),
        "rlproxy.adapter": call.get("adapter"),
        "rlproxy.api": call.get("endpoint"),
        "rlproxy.source": call.get("source"),
        "rlproxy.ttft_ms": call.get("ttft_ms"),
    }
    if attrs[MAX_TOKENS] is None:  # the newer name of the same bound
        attrs[MAX_TOKENS] = request.get("max_completion_tokens")
    if content:
        attrs.update(_messages(request, response))
    start = _ns(call.get("created_at"))
    return dict(
        trace_id=trace_id(run_id) if run_id else _id("call", capture_id, 16),
        span_id=_id("call", capture_id, 8),
        name=f"{operation} {request.get('model') or call.get('policy') or ''}".strip(),
        kind=Span.SPAN_KIND_CLIENT,
        start_time_unix_nano=start,
        end_time_unix_nano=start + int((call.get("latency_ms") or 0.0) * 1e6),
        attributes=_attributes(attrs),
        status={"code": Status.STATUS_CODE_ERROR, "message": call.get("error") or ""} if failed else {},
    )


def reward_span(run_id: str, reward: float, at: datetime | None, **more: Any) -> dict[str, Any]:
    """The span a run's reward is (module doc), as `call_span` gives it: `more` are further
    rlproxy.* attributes."""
    at_ns = _ns(at)
    attrs = {"rlproxy.run_id": run_id, "rlproxy.reward": float(reward)}
    attrs.update({f"rlproxy.{k}": v for k, v in more.items()})
    return dict(
        trace_id=trace_id(run_id),
        span_id=_id("reward", run_id, 8),
        name=REWARD_SPAN,
        kind=Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=at_ns,
        end_time_unix_nano=at_ns,
        attributes=_attributes(attrs),
    )


def export_request(spans: Iterable[dict[str, Any]] = ()) -> ExportTraceServiceRequest:
    """The OTLP request that carries `spans` (`call_span`'s; resource service.name "rlproxy", scope
    "rlproxy"); `add_span` adds more."""
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=_attributes({"service.name": SERVICE_NAME})),
                scope_spans=[ScopeSpans(scope=InstrumentationScope(name="rlproxy"))],
            )
        ]
    )
    for span in spans:
        add_span(request, span)
    return request


def add_span(request: ExportTraceServiceRequest, span: dict[str, Any]) -> None:
    """Add a span (`call_span`'s) to `request`'s one scope, built in place."""
    request.resource_spans[0].scope_spans[0].spans.add(**span)


def json_line(request: ExportTraceServiceRequest) -> bytes:
    """`request` as OTLP/JSON on one line (as the collector's file exporter writes it): camelCase
    keys, enums as integers, trace and span ids as hex (not protobuf JSON's base64)."""
    out = MessageToDict(request, use_integers_for_enums=True)
    for rs in out.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for span in ss.get("spans", ()):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = base64.b64decode(span[key]).hex()
    return orjson.dumps(out) + b"\n"
