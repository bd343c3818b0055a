"""Capture helpers, pure: injection, stripping, stream assembly, the default group."""

from __future__ import annotations

from rlproxy.proxy import capture
from rlproxy.proxy.runkey import default_group
from rlproxy.proxy.stream import _empty
from rlproxy.storage.records import Endpoint


def test_inject_only_what_the_client_did_not_ask():
    body = {"messages": []}
    inj = capture.inject(body, Endpoint.CHAT)
    assert body["return_token_ids"] is True and body["logprobs"] is True and inj.token_ids and inj.logprobs
    body = {"prompt": "x", "logprobs": 2, "return_token_ids": True}
    inj = capture.inject(body, Endpoint.COMPLETIONS)
    assert not inj.any and body["logprobs"] == 2
    body = {"prompt": "x"}
    assert capture.inject(body, Endpoint.COMPLETIONS).logprobs and body["logprobs"] == 0


def test_from_response_captures_then_strips_to_nulls():
    resp = {
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "message": {"content": "ab"},
                "token_ids": [5, 6],
                "finish_reason": "stop",
                "logprobs": {"content": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]},
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2},
    }
    cap = capture.from_response(resp, Endpoint.CHAT, capture.Injected(True, True))
    assert cap.prompt_token_ids == [1, 2] and cap.token_ids == [[5, 6]] and cap.logprobs == [[-0.1, -0.2]]
    assert cap.finish_reason == "stop" and cap.completion_tokens == 2
    assert resp["prompt_token_ids"] is None
    assert resp["choices"][0]["token_ids"] is None and resp["choices"][0]["logprobs"] is None
    assert resp["choices"][0]["message"] == {"content": "ab"}


def test_stream_assembler_chat_with_tool_calls_and_two_choices():
    a = capture.StreamAssembler(Endpoint.CHAT, capture.Injected(True, True))
    chunks = [
        {
            "id": "c",
            "created": 1,
            "model": "m",
            "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        },
        {"choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "Hel"},
                    "token_ids": [7],
                    "logprobs": {"content": [{"logprob": -1.0}]},
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 1,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call1",
                                "type": "function",
                                "function": {"name": "get", "arguments": '{"ci'},
                            }
                        ]
                    },
                    "token_ids": [8, 9],
                    "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]},
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 1,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]},
                    "token_ids": [10],
                    "logprobs": {"content": [{"logprob": -0.125}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "lo"},
                    "token_ids": [11],
                    "logprobs": {"content": [{"logprob": -2.0}]},
                    "finish_reason": "stop",
                }
            ]
        },
    ]
    for c in chunks:
        a.feed(c)
    cap = a.result()
    assert cap.prompt_token_ids == [1, 2] and cap.token_ids == [[7, 11], [8, 9, 10]]
    assert cap.logprobs == [[-1.0, -2.0], [-0.5, -0.25, -0.125]]
    assert cap.prompt_tokens == 2 and cap.completion_tokens == 5 and cap.finish_reason == "stop"
    c0, c1 = cap.response["choices"]
    assert c0["message"]["content"] == "Hello" and c0["logprobs"] is None
    assert c1["message"]["tool_calls"] == [
        {"id": "call1", "type": "function", "function": {"name": "get", "arguments": '{"city": 1}'}}
    ]
    assert c1["finish_reason"] == "tool_calls"
    assert "prompt_token_ids" not in cap.response  # injected: not part of what the client got


def test_stream_assembler_completions_keeps_client_logprobs():
    a = capture.StreamAssembler(Endpoint.COMPLETIONS, capture.Injected(True, False))
    a.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "a",
                    "prompt_token_ids": [3],
                    "token_ids": [4],
                    "logprobs": {
                        "tokens": ["a"],
                        "token_logprobs": [-0.5],
                        "text_offset": [0],
                        "top_logprobs": [{"a": -0.5}],
                    },
                }
            ]
        }
    )
    a.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "b",
                    "token_ids": [5],
                    "finish_reason": "length",
                    "logprobs": {
                        "tokens": ["b"],
                        "token_logprobs": [-0.7],
                        "text_offset": [1],
                        "top_logprobs": [{"b": -0.7}],
                    },
                }
            ]
        }
    )
    cap = a.result()
    assert cap.prompt_token_ids == [3] and cap.token_ids == [[4, 5]] and cap.logprobs == [[-0.5, -0.7]]
    choice = cap.response["choices"][0]
    assert choice["text"] == "ab" and choice["logprobs"]["tokens"] == ["a", "b"]


def test_chunks_left_empty_by_stripping_are_dropped():
    assert _empty(
        {"choices": [{"index": 0, "delta": {}, "logprobs": None, "token_ids": None, "finish_reason": None}]}
    )
    assert not _empty({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert not _empty({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert not _empty({"choices": [], "usage": {"prompt_tokens": 1}})


def test_default_group_ignores_what_comes_after_the_first_user_message():
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "task 1"}]
    g1 = default_group("p", {"messages": base + [{"role": "assistant", "content": "x"}]})
    g2 = default_group("p", {"messages": base})
    assert g1 == g2
    assert g1 != default_group("q", {"messages": base})
    assert g1 != default_group("p", {"messages": base, "tools": [{"type": "function"}]})
    assert default_group("p", {"prompt": "a"}) != default_group("p", {"prompt": "b"})
