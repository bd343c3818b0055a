"""Capture helpers, pure: injection, stripping, stream assembly, the default group."""

from __future__ import annotations

import orjson

from rlproxy.proxy import capture
from rlproxy.proxy.runkey import default_group
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
    assert "prompt_token_ids" not in resp  # not OpenAI's fields: gone, not null (issue 56)
    assert "token_ids" not in resp["choices"][0] and resp["choices"][0]["logprobs"] is None
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


def _stripped_empty(chunk: dict) -> bool:
    """What `feed(chunk, strip=True)` returns, said plainly (the oracle): after stripping, the
    chunk has no usage and choices none of which carries anything."""
    if chunk.get("usage") or not chunk.get("choices"):
        return False
    for c in chunk["choices"]:
        if c.get("finish_reason") is not None or c.get("logprobs") is not None:
            return False
        if c.get("token_ids") is not None or c.get("text"):
            return False
        delta = c.get("delta")
        if delta and (not isinstance(delta, dict) or any(delta.values())):  # (one not an object: sent)
            return False
    return True


def _feed(endpoint: str, inj: capture.Injected, chunk: dict) -> bool:
    return capture.StreamAssembler(endpoint, inj).feed(chunk, strip=True)


def test_chunks_left_empty_by_stripping_are_dropped():
    both = capture.Injected(True, True)
    assert _feed(
        Endpoint.CHAT,
        both,
        {"choices": [{"index": 0, "delta": {}, "logprobs": {"content": []}, "token_ids": [5]}]},
    )
    assert not _feed(
        Endpoint.CHAT, both, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    )
    assert not _feed(Endpoint.CHAT, both, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert not _feed(Endpoint.CHAT, both, {"choices": [], "usage": {"prompt_tokens": 1}})
    # what the client asked for itself is never stripped, so a chunk carrying it is not empty
    assert not _feed(
        Endpoint.CHAT,
        capture.Injected(True, False),
        {"choices": [{"index": 0, "delta": {}, "logprobs": {"content": []}, "token_ids": [5]}]},
    )
    assert _feed(
        Endpoint.COMPLETIONS, both, {"choices": [{"index": 0, "text": "", "token_ids": [5], "logprobs": {}}]}
    )
    assert not _feed(Endpoint.COMPLETIONS, both, {"choices": [{"index": 0, "text": "a", "token_ids": [5]}]})
    # without strip: folded only, never called empty, nothing changed
    chunk = {"choices": [{"index": 0, "delta": {}, "token_ids": [5]}]}
    assert not capture.StreamAssembler(Endpoint.CHAT, both).feed(chunk) and chunk["choices"][0][
        "token_ids"
    ] == [5]


def test_feed_strips_as_strip_does_and_folds_the_same():
    """One pass (fold + strip + emptiness) against the three it replaced, over chunks of every
    shape a stream carries (and some it should not), for each injection and endpoint."""
    lp_chat = {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": []}]}
    lp_text = {"tokens": ["a"], "token_logprobs": [-0.5], "text_offset": [0], "top_logprobs": None}
    choices = [
        {"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "a"}, "logprobs": lp_chat, "token_ids": [7], "finish_reason": None},
        {"index": 0, "delta": {}, "logprobs": lp_chat, "token_ids": [8], "finish_reason": None},
        {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "token_ids": None,
            "finish_reason": "stop",
            "stop_reason": 2,
        },
        {
            "index": 1,
            "delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}]},
        },
        {"index": 0, "delta": {"reasoning_content": "r"}, "token_ids": [9]},
        {"index": 0, "text": "a", "logprobs": lp_text, "token_ids": [7], "prompt_token_ids": [1, 2]},
        {"index": 0, "text": "", "logprobs": lp_text, "token_ids": [8]},
        {"index": 0, "text": "", "token_ids": [], "logprobs": {}},
        {"index": "x", "delta": {"content": None}, "token_ids": ["no"]},
        {"index": 0},
        {"index": 0, "delta": {}, "text": "t", "token_ids": [3]},  # a stray text on a chat chunk
        {"index": 0, "delta": ["x"], "token_ids": [3]},  # a delta that is no object
    ]
    chunks = [{"id": "c1", "choices": [c]} for c in choices]
    chunks += [
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}},
        {"id": "c1", "choices": None, "prompt_token_ids": [1, 2]},
        {"id": "c1", "prompt_token_ids": [1, 2], "choices": [choices[1], choices[2]]},
        {"id": "c1", "choices": [choices[2]], "usage": {"prompt_tokens": 2}},
    ]
    for endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS):
        for inj in (
            capture.Injected(True, True),
            capture.Injected(True, False),
            capture.Injected(False, True),
        ):
            one, three = capture.StreamAssembler(endpoint, inj), capture.StreamAssembler(endpoint, inj)
            for chunk in chunks:
                a, b = orjson.loads(orjson.dumps(chunk)), orjson.loads(orjson.dumps(chunk))
                empty = one.feed(a, strip=True)
                three.feed(b)  # the old way: fold, then strip, then ask
                capture.strip(b, inj)
                assert a == b, (endpoint, inj, chunk)
                assert empty == _stripped_empty(b), (endpoint, inj, chunk)
            r1, r3 = one.result(), three.result()
            assert (r1.response, r1.token_ids, r1.logprobs, r1.prompt_token_ids) == (
                r3.response,
                r3.token_ids,
                r3.logprobs,
                r3.prompt_token_ids,
            )
            assert one.malformed and three.malformed  # the "x" index and ["no"] token ids


def test_default_group_ignores_what_comes_after_the_first_user_message():
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "task 1"}]
    g1 = default_group("p", {"messages": base + [{"role": "assistant", "content": "x"}]})
    g2 = default_group("p", {"messages": base})
    assert g1 == g2
    assert g1 != default_group("q", {"messages": base})
    assert g1 != default_group("p", {"messages": base, "tools": [{"type": "function"}]})
    assert default_group("p", {"prompt": "a"}) != default_group("p", {"prompt": "b"})
