"""The Responses <-> chat-completions translation: table-driven, and every object and event emitted
must parse with the openai package's own types (what the SDK does with them)."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from rlproxy.wire.response_events import ResponseEvents, response_object
from rlproxy.wire.responses import ResponsesInputError, chat_request, conversation

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": WEATHER["parameters"],
        "strict": True,
    },
}

REQUESTS = [
    (
        "string input",
        {"model": "m", "input": "hi"},
        None,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    ),
    (
        "instructions and sampling",
        {
            "input": "hi",
            "instructions": "be brief",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "user": "u1",
            "stop": ["\n"],
            "metadata": {"k": "v"},
            "store": False,
            "truncation": "disabled",
            "reasoning": {"effort": "low"},
            "prompt_cache_key": "x",
            "include": [],
        },
        None,
        {
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "user": "u1",
            "stop": ["\n"],
        },
    ),
    (
        "items with parts, developer role, reasoning dropped",
        {
            "input": [
                {"role": "developer", "content": "rules"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "ok", "annotations": []}],
                },
                {"role": "user", "content": "more"},
            ]
        },
        None,
        {
            "messages": [
                {"role": "system", "content": "rules"},
                {"role": "user", "content": "ab"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "more"},
            ]
        },
    ),
    (
        "tools, tool_choice, function_call + function_call_output",
        {
            "input": [
                {"role": "user", "content": "weather in Paris?"},
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city":"Paris"}',
                    "status": "completed",
                },
                {
                    "type": "function_call",
                    "call_id": "call_2",
                    "name": "get_weather",
                    "arguments": '{"city":"Rome"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "rain"}],
                },
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
        },
        None,
        {
            "messages": [
                {"role": "user", "content": "weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
            ],
            "tools": [CHAT_WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
        },
    ),
    (
        "history: earlier system dropped, new instructions lead",
        {"input": "and now?", "instructions": "new", "previous_response_id": "resp_1"},
        [
            {"role": "system", "content": "old"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ],
        {
            "messages": [
                {"role": "system", "content": "new"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "and now?"},
            ]
        },
    ),
    (
        "text.format json_schema, stream, logprobs include",
        {
            "input": "x",
            "stream": True,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 2,
            "text": {
                "format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}
            },
        },
        None,
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
            },
        },
    ),
    (
        "text.format text is the default",
        {"input": "x", "text": {"format": {"type": "text"}}},
        None,
        {"messages": [{"role": "user", "content": "x"}]},
    ),
    (
        "json_object",
        {"input": "x", "text": {"format": {"type": "json_object"}}},
        None,
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
    ),
]


@pytest.mark.parametrize(("name", "body", "history", "want"), REQUESTS, ids=[r[0] for r in REQUESTS])
def test_chat_request(name: str, body: dict, history: list | None, want: dict) -> None:
    assert chat_request(body, history) == want


def test_history_is_not_mutated() -> None:
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]
    chat_request(
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, history
    )
    assert history == [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]


BAD = [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "temperature": True}, "temperature"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_input_names_the_param(body: dict, param: str) -> None:
    with pytest.raises(ResponsesInputError) as info:
        chat_request(body)
    assert info.value.param == param
    assert isinstance(info.value, ValueError) and str(info.value)


def _chat(message: dict, finish: str = "stop", logprobs: list | None = None) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "policy@2",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": {"content": logprobs} if logprobs else None,
                "token_ids": [5, 6],
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
        "prompt_token_ids": [1, 2, 3],
    }


def test_response_object_text() -> None:
    body = {
        "model": "policy",
        "input": "hi",
        "instructions": "sys",
        "metadata": {"a": "b"},
        "max_output_tokens": 9,
        "temperature": 0.3,
    }
    out = response_object(
        body, _chat({"role": "assistant", "content": "hello"}), response_id="resp_x", created_at=7
    )
    parsed = Response.model_validate(out)
    assert parsed.id == "resp_x" and parsed.created_at == 7 and parsed.status == "completed"
    assert parsed.output_text == "hello" and parsed.model == "policy@2"
    assert parsed.instructions == "sys" and parsed.metadata == {"a": "b"} and parsed.max_output_tokens == 9
    assert parsed.temperature == 0.3 and parsed.tool_choice == "none" and parsed.tools == []
    assert (
        parsed.usage.input_tokens == 10
        and parsed.usage.output_tokens == 2
        and parsed.usage.total_tokens == 12
    )
    assert parsed.usage.input_tokens_details.cached_tokens == 0
    assert parsed.output[0].content[0].logprobs == []  # not asked for: not given
    assert "token_ids" not in json.dumps(out) and "prompt_token_ids" not in json.dumps(out)


def test_response_object_logprobs_when_included() -> None:
    body = {"input": "hi", "include": ["message.output_text.logprobs"]}
    entries = [
        {"token": "he", "logprob": -0.5, "bytes": [104, 101], "top_logprobs": []},
        {"token": "llo", "logprob": -0.1, "top_logprobs": []},
    ]
    out = response_object(
        body,
        _chat({"role": "assistant", "content": "hello"}, logprobs=entries),
        response_id="r",
        created_at=1,
    )
    lps = Response.model_validate(out).output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in lps] == [("he", -0.5), ("llo", -0.1)]
    assert lps[1].bytes == list(b"llo")


def test_response_object_tool_calls_and_length_cut() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_9",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
            }
        ],
    }
    body = {"input": "w?", "tools": [WEATHER]}
    parsed = Response.model_validate(response_object(body, _chat(message), response_id="r", created_at=1))
    assert [o.type for o in parsed.output] == ["function_call"]
    call = parsed.output[0]
    assert (call.call_id, call.name, call.arguments, call.status) == (
        "call_9",
        "get_weather",
        '{"city":"Oslo"}',
        "completed",
    )
    assert call.id.startswith("fc_") and parsed.tool_choice == "auto"

    cut = Response.model_validate(
        response_object(
            {"input": "x", "max_output_tokens": 2},
            _chat({"role": "assistant", "content": "ab"}, "length"),
            response_id="r",
            created_at=1,
        )
    )
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def _chunk(
    delta: dict | None = None,
    finish: str | None = None,
    usage: dict | None = None,
    logprobs: list | None = None,
) -> dict:
    choices = (
        []
        if delta is None
        else [
            {
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": {"content": logprobs} if logprobs else None,
            }
        ]
    )
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": choices,
        "usage": usage,
    }


def _run(body: dict, chunks: list[dict]) -> tuple[list[dict], ResponseEvents]:
    ev = ResponseEvents(body, response_id="resp_s", created_at=3, model="m")
    events = ev.start()
    for c in chunks:
        events += ev.feed(c)
    events += ev.finish()
    for e in events:
        EVENT.validate_python(e)  # every event parses as the SDK parses it
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    Response.model_validate(ev.response)
    return events, ev


def test_stream_text() -> None:
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hel"}, logprobs=[{"token": "Hel", "logprob": -1.0}]),
        _chunk({}),
        _chunk({"content": "lo"}),
        _chunk({}, "stop"),
        _chunk(None, usage=usage),
    ]
    events, ev = _run({"input": "hi"}, chunks)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[4]["logprobs"] == []  # not included: not sent
    assert events[6]["text"] == "Hello"
    assert events[2]["item"]["id"] == events[8]["item"]["id"] == ev.response["output"][0]["id"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello" and final.status == "completed" and final.usage.total_tokens == 7


def test_stream_tool_call_after_text() -> None:
    chunks = [
        _chunk({"role": "assistant", "content": "Let me check."}),
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "{}"},
                    }
                ]
            }
        ),
        _chunk({}, "tool_calls"),
    ]
    events, ev = _run({"input": "w?", "tools": [WEATHER]}, chunks)
    types = [e["type"] for e in events]
    assert types.count("response.output_item.added") == 3 and types.count("response.output_item.done") == 3
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(d["arguments"], d["name"], d["output_index"]) for d in done] == [
        ('{"city":"Oslo"}', "get_weather", 1),
        ("{}", "get_weather", 2),
    ]
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert [o.call_id for o in final.output[1:]] == ["call_1", "call_2"]
    assert final.output[0].content[0].text == "Let me check."


def test_stream_length_cut_is_incomplete_and_fail_is_failed() -> None:
    events, ev = _run({"input": "x", "max_output_tokens": 2}, [_chunk({"content": "ab"}, "length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}

    ev = ResponseEvents({"input": "x"}, response_id="r", created_at=1, model="m")
    events = ev.start() + ev.feed(_chunk({"content": "a"})) + ev.fail("upstream stream broke")
    for e in events:
        EVENT.validate_python(e)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "upstream stream broke"


def test_stream_logprobs_when_included() -> None:
    body = {"input": "x", "include": ["message.output_text.logprobs"]}
    events, _ = _run(
        body,
        [
            _chunk({"content": "a"}, logprobs=[{"token": "a", "logprob": -0.2, "top_logprobs": []}]),
            _chunk({}, "stop"),
        ],
    )
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    assert [(lp["token"], lp["logprob"]) for lp in delta["logprobs"]] == [("a", -0.2)]


def test_conversation_round_trip() -> None:
    """conversation() of one turn, fed back as history, gives the chat messages of the next turn."""
    first = chat_request({"input": "weather?", "instructions": "sys", "tools": [WEATHER]})
    answer = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "hmm",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        ],
    }
    history = conversation(first, answer)
    assert history == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": answer["tool_calls"]},
    ]
    second = chat_request(
        {
            "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
            "instructions": "sys",
        },
        history,
    )
    assert second["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": answer["tool_calls"]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
