"""LangSmith export records -> model calls and feedback.

The shapes are the LangSmith SDK's own models (`langsmith.schemas.Run` and `Feedback`, as
`Client.list_runs`/`list_feedback` return them and `model_dump_json` writes them; the REST API sends
the same fields). A run of `run_type` llm is a model call: `inputs` the request as the traced client
got it (`wrap_openai`: `messages`, `tools`, `model`, parameters), `outputs` its reply (a
chat.completion, or `{"message": ...}`); the run's trace is `trace_id`. `feedback_stats` on a run and
Feedback records give scores: the run's reward (source `langsmith`) and metrics by key.
"""

from __future__ import annotations

from typing import Any

from rlproxy.traces.readers import Malformed, Read, RunNote, chat_call, run_key, timestamp

SOURCE = "langsmith"
_NOT_PARAMS = ("messages", "tools", "model", "stream", "stream_options", "extra_headers", "extra_body")


def read_langsmith(record: dict[str, Any]) -> Read:
    """One LangSmith Run or Feedback record as its call and scores."""
    out = Read()
    trace = str(record.get("trace_id") or record.get("run_id") or record.get("id") or "")
    if not trace:
        raise Malformed("a LangSmith record without its trace_id or id")
    if "key" in record and "run_id" in record:  # Feedback
        score = record.get("score")
        if isinstance(score, bool | int | float):
            out.notes.append(_note(trace, {str(record["key"]): float(score)}))
        return out
    stats = record.get("feedback_stats") or {}
    scores = {
        k: float(v["avg"])
        for k, v in stats.items()
        if isinstance(v, dict) and isinstance(v.get("avg"), int | float)
    }
    if scores:
        out.notes.append(_note(trace, scores))
    if record.get("run_type") != "llm":
        return out
    inputs = record.get("inputs") or {}
    outputs = record.get("outputs") or {}
    reply = outputs.get("message")
    choices = outputs.get("choices")
    if isinstance(choices, list) and choices:
        reply = choices[0].get("message")
    usage = outputs.get("usage") or {}
    extra = record.get("extra") or {}
    meta = extra.get("metadata") or {}
    out.calls.append(
        chat_call(
            trace_id=trace,
            span_id=str(record.get("id")),
            model=inputs.get("model") or meta.get("ls_model_name"),
            messages=inputs.get("messages"),
            reply=dict(reply) if isinstance(reply, dict) else None,
            tools=inputs.get("tools"),
            params={k: v for k, v in inputs.items() if k not in _NOT_PARAMS},
            finish_reason=choices[0].get("finish_reason") if isinstance(choices, list) and choices else None,
            usage=(
                usage.get("prompt_tokens", record.get("prompt_tokens")),
                usage.get("completion_tokens", record.get("completion_tokens")),
            ),
            started=timestamp(record.get("start_time")),
            ended=timestamp(record.get("end_time")),
        )
    )
    return out


def _note(trace: str, scores: dict[str, float]) -> RunNote:
    return RunNote(
        run_key(trace),
        reward=next(iter(scores.values())),
        reward_source=SOURCE,
        metrics=scores,
        metadata={"trace_id": trace},
    )
