"""Langfuse export records -> model calls and scores.

The shapes are those of Langfuse's public API, which its UI and SDK exports share (fields in
camelCase as the API sends them, or snake_case as the Python SDK's models dump them): an
observation (`GET /api/public/v2/observations`, the SDK's `ObservationV2`; only `type`
GENERATION holds a model call: `input` the messages, or `{"messages", "tools"}`, `output` the
reply), a score (`Score_Numeric`/`Score_Boolean`: `traceId`, `name`, `value`), a trace with its
`observations` and `scores` (`GET /api/public/traces/{id}`), or a page of any of them
(`{"data": [...], "meta": ...}`). A numeric or boolean score becomes the run's reward (source
`langfuse`) and a metric by its name.
"""

from __future__ import annotations

from typing import Any

from rlproxy.traces.readers import Malformed, Read, RunNote, chat_call, run_key, timestamp

SOURCE = "langfuse"


def _get(record: dict[str, Any], snake: str) -> Any:
    """A field by its SDK (snake_case) or API (camelCase) name."""
    head, *rest = snake.split("_")
    return record.get(snake, record.get(head + "".join(w.title() for w in rest)))


def read_langfuse(record: dict[str, Any]) -> Read:
    """One Langfuse record (any shape above) as its calls and scores."""
    out = Read()
    if isinstance(record.get("data"), list):  # an API page
        for item in record["data"]:
            _merge(out, read_langfuse(item))
        return out
    if isinstance(record.get("observations"), list) or isinstance(record.get("scores"), list):  # a trace
        for item in [*(record.get("observations") or []), *(record.get("scores") or [])]:
            _merge(out, read_langfuse({"traceId": record.get("id"), **item}))
        return out
    trace = _get(record, "trace_id")
    if not isinstance(trace, str) or not trace:
        raise Malformed("a Langfuse record without its traceId")
    if "value" in record and "name" in record and "type" not in record:
        return _score(record, trace)
    if record.get("type") != "GENERATION":
        return out  # a span or an event of the trace: no model call
    messages, tools = record.get("input"), None
    if isinstance(messages, dict):
        messages, tools = messages.get("messages"), messages.get("tools")
    reply = record.get("output")
    if isinstance(reply, dict) and isinstance(reply.get("choices"), list) and reply["choices"]:
        reply = reply["choices"][0].get("message")
    if isinstance(reply, str):
        reply = {"content": reply}
    usage = _get(record, "usage_details") or record.get("usage") or {}
    params = _get(record, "model_parameters") or {}
    out.calls.append(
        chat_call(
            trace_id=trace,
            span_id=str(record.get("id")),
            model=record.get("model"),
            messages=messages,
            reply=dict(reply) if isinstance(reply, dict) else None,
            tools=tools,
            params=params if isinstance(params, dict) else {},
            usage=(
                usage.get("input", usage.get("prompt_tokens")),
                usage.get("output", usage.get("completion_tokens")),
            ),
            started=timestamp(_get(record, "start_time")),
            ended=timestamp(_get(record, "end_time")),
        )
    )
    return out


def _score(record: dict[str, Any], trace: str) -> Read:
    value = record.get("value")
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float):
        return Read()  # a categorical or text score: no number to learn from
    note = RunNote(
        run_key(trace),
        reward=float(value),
        reward_source=SOURCE,
        metrics={str(record["name"]): float(value)},
        metadata={"trace_id": trace},
    )
    return Read(notes=[note])


def _merge(into: Read, more: Read) -> None:
    into.calls += more.calls
    into.notes += more.notes
