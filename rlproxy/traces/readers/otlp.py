"""OTLP traces (an `ExportTraceServiceRequest` as JSON) -> the model calls of its GenAI spans.

The JSON is OTLP/JSON as the collector's file exporter writes it (one request per line, ids in hex)
or protobuf's own JSON mapping of the same message (`json_format.MessageToDict`: ids in base64);
both are read (`imports.py` turns a protobuf file into the latter). A span is a model call when it
carries the GenAI conventions' messages (`gen_ai.input.messages`, as the official OpenAI
instrumentation writes them with content capture on spans) or is an OpenInference LLM span
(`openinference.span.kind` LLM: flattened `llm.input_messages.N.message.*`); other spans (tools,
agents, HTTP) hold no call and are passed over. A call keeps what the span says: model, messages,
tools, parameters, usage, finish reason, times; the run is the span's trace.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import UTC, datetime
from typing import Any

from rlproxy.traces import genai
from rlproxy.traces.readers import Malformed, Read, chat_call, timestamp

_EPOCH = datetime.fromtimestamp(0, UTC)


def read_request(request: dict[str, Any]) -> Read:
    """The calls of every GenAI span of one ExportTraceServiceRequest."""
    out = Read()
    resources = request.get("resourceSpans")
    if not isinstance(resources, list):
        raise Malformed("no resourceSpans: not an OTLP trace export")
    for resource in resources:
        for scope in resource.get("scopeSpans") or []:
            for span in scope.get("spans") or []:
                call = read_span(span)
                if call is not None:
                    out.calls.append(call)
    out.calls.sort(key=lambda c: (c.run_id or "", c.created_at or _EPOCH))  # a trace's calls in time order
    return out


def read_span(span: dict[str, Any]) -> Any:
    """One span's call (a CompletionRecord), or None when the span holds none."""
    attrs = attributes(span.get("attributes"))
    for event in span.get("events") or []:  # semconv: content may travel in an operation-details event
        if event.get("name") == "gen_ai.client.inference.operation.details":
            attrs = {**attributes(event.get("attributes")), **attrs}
    if genai.INPUT_MESSAGES in attrs:
        fields = _genai(attrs)
    elif attrs.get(genai.OI_SPAN_KIND) == "LLM":
        fields = _openinference(attrs)
    else:
        return None
    return chat_call(
        trace_id=span_id(span.get("traceId"), 16),
        span_id=span_id(span.get("spanId"), 8),
        started=timestamp(span.get("startTimeUnixNano")),
        ended=timestamp(span.get("endTimeUnixNano")),
        **fields,
    )


def span_id(value: Any, size: int) -> str:
    """An OTLP id as lowercase hex: OTLP/JSON writes hex, protobuf's JSON mapping base64."""
    if not isinstance(value, str) or not value:
        raise Malformed("a span without its trace or span id")
    if len(value) == 2 * size:
        try:
            bytes.fromhex(value)
            return value.lower()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error:
        raise Malformed(f"not an OTLP id: {value!r}") from None
    if len(raw) != size:
        raise Malformed(f"not an OTLP id: {value!r}")
    return raw.hex()


def attributes(items: Any) -> dict[str, Any]:
    """OTLP key-value pairs as a plain dict (an AnyValue's one field unwrapped, lists and maps too)."""
    return {
        kv["key"]: _value(kv.get("value") or {}) for kv in items or [] if isinstance(kv, dict) and "key" in kv
    }


def _value(v: dict[str, Any]) -> Any:
    for key, value in v.items():
        if key in ("stringValue", "boolValue", "doubleValue", "bytesValue"):
            return value
        if key == "intValue":
            return int(value)
        if key == "arrayValue":
            return [_value(x) for x in value.get("values") or []]
        if key == "kvlistValue":
            return attributes(value.get("values"))
    return None


def _json(attrs: dict[str, Any], key: str) -> Any:
    value = attrs.get(key)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise Malformed(f"{key} is not JSON") from None
    return value


# -- GenAI semantic conventions --------------------------------------------------------------------


def _genai(attrs: dict[str, Any]) -> dict[str, Any]:
    messages = [m for msg in _json(attrs, genai.INPUT_MESSAGES) or [] for m in _from_parts(msg)]
    system = _json(attrs, genai.SYSTEM_INSTRUCTIONS)
    if system:
        messages.insert(0, {"role": "system", "content": _text(system)})
    outputs = _json(attrs, genai.OUTPUT_MESSAGES) or []
    reply = _from_parts(outputs[0])[0] if outputs else None
    reasons = attrs.get(genai.FINISH_REASONS) or []
    finish = (outputs[0].get("finish_reason") if outputs else None) or (reasons[0] if reasons else None)
    if reply is not None:
        reply.pop("role", None)
    return {
        "model": attrs.get(genai.REQUEST_MODEL) or attrs.get(genai.RESPONSE_MODEL),
        "messages": messages,
        "reply": reply,
        "tools": [_tool(t) for t in _json(attrs, genai.TOOL_DEFINITIONS) or []],
        "params": {name: attrs.get(key) for key, name in genai.REQUEST_PARAMS.items()},
        "finish_reason": finish,
        "usage": (attrs.get(genai.INPUT_TOKENS), attrs.get(genai.OUTPUT_TOKENS)),
        "response_id": attrs.get(genai.RESPONSE_ID),
    }


def _tool(tool: Any) -> Any:
    """A semconv tool definition (`{"type": "function", "name", "description", "parameters"}`) in
    OpenAI's request shape (the function's fields under `function`); one already so, as it is."""
    if not isinstance(tool, dict) or "function" in tool or "name" not in tool:
        return tool
    return {"type": tool.get("type", "function"), "function": {k: v for k, v in tool.items() if k != "type"}}


def _text(parts: list[Any]) -> str | None:
    texts = [p.get("content") for p in parts if isinstance(p, dict) and p.get("type") == genai.PART_TEXT]
    return "".join(t for t in texts if isinstance(t, str)) if texts else None


def _from_parts(msg: Any) -> list[dict[str, Any]]:
    """A semconv message (role + typed parts) as OpenAI chat messages: text joined into `content`,
    tool calls as `tool_calls`, each tool response its own `tool` message."""
    if not isinstance(msg, dict) or not isinstance(msg.get("parts"), list):
        raise Malformed("a gen_ai message without its parts")
    parts = [p for p in msg["parts"] if isinstance(p, dict)]
    responses = [p for p in parts if p.get("type") == genai.PART_TOOL_RESPONSE]
    if responses:
        return [
            {"role": "tool", "tool_call_id": p.get("id"), "content": _as_text(p.get("response"))}
            for p in responses
        ]
    out: dict[str, Any] = {"role": msg.get("role"), "content": _text(parts)}
    calls = [
        {
            "id": p.get("id"),
            "type": "function",
            "function": {"name": p.get("name"), "arguments": _as_text(p.get("arguments"))},
        }
        for p in parts
        if p.get("type") == genai.PART_TOOL_CALL
    ]
    if calls:
        out["tool_calls"] = calls
    return [out]


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# -- OpenInference ---------------------------------------------------------------------------------


def _openinference(attrs: dict[str, Any]) -> dict[str, Any]:
    body = (
        _json(attrs, genai.OI_INPUT_VALUE)
        if str(attrs.get("input.mime_type")) == "application/json"
        else None
    )
    body = body if isinstance(body, dict) else {}
    messages = _oi_messages(attrs, genai.OI_INPUT_MESSAGES) or body.get("messages") or []
    replies = _oi_messages(attrs, genai.OI_OUTPUT_MESSAGES)
    reply = replies[0] if replies else None
    if reply is not None:
        reply.pop("role", None)
    tools = []
    n = 0
    while (schema := attrs.get(f"{genai.OI_TOOLS}.{n}.tool.json_schema")) is not None:
        tools.append(json.loads(schema) if isinstance(schema, str) else schema)
        n += 1
    params = _json(attrs, genai.OI_INVOCATION_PARAMETERS) or {}
    return {
        "model": attrs.get(genai.OI_MODEL) or params.get("model") or body.get("model"),
        "messages": messages,
        "reply": reply,
        "tools": tools or body.get("tools"),
        "params": {k: v for k, v in params.items() if k != "model"},
        "finish_reason": attrs.get("llm.finish_reason"),
        "usage": (attrs.get(genai.OI_PROMPT_TOKENS), attrs.get(genai.OI_COMPLETION_TOKENS)),
    }


def _oi_messages(attrs: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    out = []
    n = 0
    while (role := attrs.get(genai.oi_message(prefix, n, "role"))) is not None:
        key = genai.oi_message(prefix, n, "")
        msg: dict[str, Any] = {"role": role, "content": attrs.get(key + "content")}
        for field in ("name", "tool_call_id"):
            if attrs.get(key + field) is not None:
                msg[field] = attrs[key + field]
        calls = []
        k = 0
        while (name := attrs.get(f"{key}tool_calls.{k}.tool_call.function.name")) is not None:
            call = f"{key}tool_calls.{k}.tool_call."
            calls.append(
                {
                    "id": attrs.get(call + "id"),
                    "type": "function",
                    "function": {"name": name, "arguments": attrs.get(call + "function.arguments", "")},
                }
            )
            k += 1
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
        n += 1
    return out
