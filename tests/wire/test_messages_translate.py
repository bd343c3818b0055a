"""The Messages <-> chat-completions translation: table-driven, and every object and event emitted
must parse with the `anthropic` package's own types (what the SDK does with them)."""

from __future__ import annotations

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from rlproxy.wire.message_events import MessageEvents, count_object, message_object, stop_reason
from rlproxy.wire.messages import MessagesInputError, chat_request, count_request, error_body, error_status

EVENT = TypeAdapter(RawMessageStreamEvent)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"name": "w", "description": "d", "input_schema": SCHEMA, "cache_control": {"type": "ephemeral"}}
CHAT_TOOL = {"type": "function", "function": {"name": "w", "parameters": SCHEMA, "description": "d"}}
HI = [{"role": "user", "content": "hi"}]


def req(**kw):
    return {"model": "m", "max_tokens": 5, "messages": HI, **kw}


REQUESTS = [
    ("plain", req(), {"model": "m", "max_tokens": 5, "messages": HI}),
    (
        "system string, sampling, stops, stream",
        req(system="s", temperature=0.5, top_p=0.9, top_k=3, stop_sequences=["X"], stream=True, seed=1),
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "system", "content": "s"}, *HI],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 3,
            "seed": 1,
            "stop": ["X"],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "system blocks: cache_control accepted, billing header dropped, joined by newlines",
        req(
            system=[
                {"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "b"},
            ]
        ),
        {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "a\nb"}, *HI]},
    ),
    (
        "recorded, not honored: metadata, thinking, context_management, output_config.effort, unknown",
        req(
            metadata={"user_id": '{"session_id": "s"}'},
            thinking={"type": "adaptive"},
            context_management={"edits": []},
            output_config={"effort": "high"},
            service_tier="auto",
            speed="fast",
        ),
        {"model": "m", "max_tokens": 5, "messages": HI},
    ),
    (
        "tools and tool_choice any, parallel off",
        req(tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True}),
        {
            "model": "m",
            "max_tokens": 5,
            "messages": HI,
            "tools": [CHAT_TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
    ),
    (
        "tool_choice tool and none",
        req(tools=[TOOL], tool_choice={"type": "tool", "name": "w"}),
        {
            "model": "m",
            "max_tokens": 5,
            "messages": HI,
            "tools": [CHAT_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "w"}},
        },
    ),
    (
        "tool_choice none without tools is nothing",
        req(tool_choice={"type": "none"}),
        {"model": "m", "max_tokens": 5, "messages": HI},
    ),
    (
        "multi-turn: tool_use, tool_result (string and blocks, before the user's text), thinking dropped",
        req(
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "ok"},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}},
                        {"type": "tool_use", "id": "t2", "name": "w", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "sun"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t2",
                            "content": [{"type": "text", "text": "r"}, {"type": "text", "text": "s"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "next?"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t3", "name": "w", "input": {}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3"}]},
            ]
        ),
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "a\nb"},
                {
                    "role": "assistant",
                    "content": "ok",
                    "tool_calls": [
                        {
                            "id": "t1",
                            "type": "function",
                            "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
                        },
                        {"id": "t2", "type": "function", "function": {"name": "w", "arguments": "{}"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "t1", "content": "sun"},
                {"role": "tool", "tool_call_id": "t2", "content": "r\ns"},
                {"role": "user", "content": "next?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "t3", "type": "function", "function": {"name": "w", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "t3", "content": ""},
            ],
        },
    ),
    (
        "output_config.format json_schema -> response_format",
        req(output_config={"format": {"type": "json_schema", "schema": SCHEMA}}),
        {
            "model": "m",
            "max_tokens": 5,
            "messages": HI,
            "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}},
        },
    ),
]


@pytest.mark.parametrize(("name", "body", "want"), REQUESTS, ids=[r[0] for r in REQUESTS])
def test_chat_request(name: str, body: dict, want: dict) -> None:
    assert chat_request(body) == want


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
BAD = [
    ({"model": "m", "messages": HI}, "max_tokens"),
    (req(max_tokens=0), "max_tokens"),
    (req(max_tokens=True), "max_tokens"),
    ({"max_tokens": 5, "messages": HI}, "model"),
    (req(messages=[]), "messages"),
    (req(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (req(messages=[{"role": "user", "content": [IMAGE]}]), "messages[0].content[0].type"),
    (
        req(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
        "messages[0].content[0].type",
    ),
    (
        req(
            messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}
            ]
        ),
        "messages[0].content[0].content[0].type",
    ),
    (
        req(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "w"}]}]),
        "messages[0].content[0].type",
    ),
    (
        req(messages=[{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}]),
        "messages[0].content[0].type",
    ),
    (req(system=[IMAGE]), "system[0].type"),
    (req(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (req(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools[0].type"),
    (req(tools=[{"name": "w"}]), "tools[0].input_schema"),
    (req(tool_choice={"type": "any"}), "tool_choice"),
    (req(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (req(tools=[TOOL], tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (req(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), "mcp_servers"),
    (req(temperature="hot"), "temperature"),
    (req(stop_sequences="X"), "stop_sequences"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_what_cannot_be_served_is_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(MessagesInputError) as info:
        chat_request(body)
    assert info.value.param == param and param in str(info.value)


def test_count_request_needs_no_max_tokens() -> None:
    assert count_request({"model": "m", "messages": HI, "tools": [TOOL], "system": "s"}) == {
        "model": "m",
        "messages": [{"role": "system", "content": "s"}, *HI],
        "tools": [CHAT_TOOL],
    }
    assert count_object({"count": 7, "max_model_len": 512, "tokens": [1] * 7}) == {"input_tokens": 7}


def test_errors_in_anthropics_shape() -> None:
    assert error_body(400, "m") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "m"},
    }
    kinds = {s: error_body(s, "")["error"]["type"] for s in (401, 403, 404, 413, 429, 500, 502, 503, 504)}
    assert kinds == {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        502: "api_error",
        503: "overloaded_error",
        504: "timeout_error",
    }
    assert (error_status(422), error_status(415)) == (400, 415)


# ---------------------------------------------------------------------------------------------
# Answers


def chat(message: dict, finish: str = "stop", matched=None, usage=None) -> dict:
    return {
        "id": "c",
        "model": "pol@3",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "stop_reason": matched}],
        "usage": usage or {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
    }


CALL = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}


@pytest.mark.parametrize(
    ("completion", "content", "reason", "sequence"),
    [
        (chat({"content": "hey"}), [{"type": "text", "text": "hey"}], "end_turn", None),
        (chat({"content": "he"}, "length"), [{"type": "text", "text": "he"}], "max_tokens", None),
        (chat({"content": "a"}, "stop", "STOP"), [{"type": "text", "text": "a"}], "stop_sequence", "STOP"),
        (
            chat({"content": "a"}, "stop", 2),
            [{"type": "text", "text": "a"}],
            "end_turn",
            None,
        ),  # EOS token id
        (chat({"content": None}), [{"type": "text", "text": ""}], "end_turn", None),
        (
            chat({"content": "ok", "tool_calls": [CALL]}, "tool_calls"),
            [
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "call_1", "name": "w", "input": {"city": "Oslo"}},
            ],
            "tool_use",
            None,
        ),
        (
            chat({"content": None, "tool_calls": [{**CALL, "function": {"name": "w", "arguments": "[1]"}}]}),
            [{"type": "tool_use", "id": "call_1", "name": "w", "input": {"_arguments": "[1]"}}],
            "tool_use",
            None,
        ),
        (
            chat({"content": "x", "reasoning_content": "think"}),
            [{"type": "thinking", "thinking": "think", "signature": ""}, {"type": "text", "text": "x"}],
            "end_turn",
            None,
        ),
    ],
)
def test_message_object(completion: dict, content: list, reason: str, sequence: str | None) -> None:
    msg = message_object(completion, message_id="msg_1")
    Message.model_validate(msg)
    assert (msg["content"], msg["stop_reason"], msg["stop_sequence"]) == (content, reason, sequence)
    assert msg["model"] == "pol@3" and msg["id"] == "msg_1"
    assert msg["usage"] == {
        "input_tokens": 9,
        "output_tokens": 4,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def test_cached_prompt_tokens_are_not_input_tokens() -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 6}}
    msg = message_object(chat({"content": "a"}, usage=usage), message_id="m")
    assert (msg["usage"]["input_tokens"], msg["usage"]["cache_read_input_tokens"]) == (4, 6)


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]
    return {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": choices}


def run(chunks: list[dict]) -> tuple[list[dict], dict]:
    events = MessageEvents(message_id="msg_1", model="pol@0")
    out = [e for c in chunks for e in events.feed(c)] + events.finish()
    for e in out:
        if e["type"] != "ping":
            EVENT.validate_python(e)
    return out, events.response


def test_stream_text_then_tool_calls() -> None:
    call0 = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "w", "arguments": ""}}
    call1 = {"index": 1, "id": "call_b", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    first = chunk({"role": "assistant", "content": ""})
    first["prompt_token_ids"] = [1, 2, 3]
    out, msg = run(
        [
            first,
            chunk({"content": "Hel"}),
            chunk({"content": "lo"}),
            chunk({"tool_calls": [call0]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
            chunk({"tool_calls": [call1]}),
            chunk({}, "tool_calls"),
            {**chunk(), "usage": {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}},
        ]
    )
    kinds = [(e["type"], e.get("index"), (e.get("delta") or {}).get("type")) for e in out]
    assert kinds == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "input_json_delta"),
        ("content_block_delta", 1, "input_json_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert out[0]["message"]["usage"]["input_tokens"] == 3 and out[0]["message"]["content"] == []
    assert out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2]["usage"]["output_tokens"] == 6
    Message.model_validate(msg)
    assert msg["content"] == [
        {"type": "text", "text": "Hello"},
        {"type": "tool_use", "id": "call_a", "name": "w", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "call_b", "name": "w", "input": {}},
    ]


def test_stream_stop_sequence_max_tokens_and_empty() -> None:
    out, msg = run([chunk({"content": "a"}), chunk({}, "stop", stop_reason="\n\n")])
    assert out[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}
    out, msg = run([chunk({"content": "a"}, "length")])
    assert msg["stop_reason"] == "max_tokens"
    out, msg = run([])  # an upstream that sent nothing but its end: still a well-formed stream
    assert [e["type"] for e in out] == ["message_start", "ping", "message_delta", "message_stop"]


def test_stream_failure_is_an_error_event() -> None:
    events = MessageEvents(message_id="m", model="x")
    events.feed(chunk({"content": "a"}))
    assert events.fail("boom") == [{"type": "error", "error": {"type": "api_error", "message": "boom"}}]


def test_stop_reason_table() -> None:
    assert stop_reason("length", "X", True) == ("max_tokens", None)
    assert stop_reason("stop", None, True) == ("tool_use", None)
    assert stop_reason("tool_calls", None, False) == ("tool_use", None)
    assert stop_reason("stop", "X", False) == ("stop_sequence", "X")
    assert stop_reason("stop", None, False) == ("end_turn", None)
    assert stop_reason("error", None, False) == (None, None)
