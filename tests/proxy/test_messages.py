"""`POST /v1/messages` through the proxy: the real `anthropic` SDK, the embedded engine on the tiny model.

The proxy serves Anthropic's Messages API over the upstream's chat completions: what is stored is the
chat form the model saw (token ids and logprobs exactly as the chat route stores them) plus what the
client sent and got. Every object and event the client gets is validated with the SDK's own types.
Tool-call *output* needs a model that calls tools, which the random tiny model does not: those tests
use a stub upstream answering with vLLM-shaped tool calls (the test is about the translation).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from fakes import BreakingStub, ToolStub
from proxy_helpers import completion_rows as rows
from pydantic import TypeAdapter
from support import running

EVENT = TypeAdapter(RawMessageStreamEvent)
HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def client(base: str, run_id: str | None = None, **kw: Any) -> anthropic.Anthropic:
    headers = {"X-Run-Id": run_id} if run_id else None
    return anthropic.Anthropic(base_url=base, api_key="x", default_headers=headers, max_retries=0, **kw)


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event in `text`; each is the SDK's own event type, except
    `ping` (which the SDK's stream reads and skips: it must be exactly `{"type": "ping"}`) and
    `error` (which the SDK raises as an APIStatusError)."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        name, data = lines["event"], json.loads(lines["data"])
        assert data["type"] == name
        if name == "ping":
            assert data == {"type": "ping"}
        elif name != "error":
            EVENT.validate_python(data)
        out.append((name, data))
    return out


def filling(c: anthropic.Anthropic, model: str, room: int = 12, context: int = 2048) -> list[dict]:
    """A user message that leaves about `room` tokens of the tiny model's `context` (so a clamped
    `max_tokens: 32000` generates only those), sized with count_tokens."""

    def count(n: int) -> int:
        return c.messages.count_tokens(
            model=model, messages=[{"role": "user", "content": "ab " * n}]
        ).input_tokens

    base, per = count(0), (count(200) - count(0)) / 200
    n = int((context - room - base) / per)
    while count(n) > context - room:
        n -= 4
    return [{"role": "user", "content": "ab " * n}]


# ---------------------------------------------------------------------------------------------
# Captured like chat, on the real engine


def test_create_stores_tokens_like_the_same_seeded_chat_request(engine_proxy: Any) -> None:
    raw = client(engine_proxy.url, "msg-1").messages.with_raw_response.create(
        model="tiny",
        system="You are terse.",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        metadata={"user_id": "u-1"},
        extra_body={"seed": 7, "temperature": 1.0},  # the SDK (2.x) no longer lists the sampling fields
    )
    assert raw.headers["x-policy-step"] == "0"
    msg = Message.model_validate(
        json.loads(raw.http_response.text)
    )  # the SDK's own type, strictly from the bytes
    assert msg == raw.parse()
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.content[0].type == "text"
    assert (
        "token_ids" not in raw.http_response.text and "logprobs" not in raw.http_response.text
    )  # nothing of the capture leaks

    chat = openai.OpenAI(
        base_url=f"{engine_proxy.url}/v1", api_key="x", default_headers={"X-Run-Id": "chat-1"}
    ).chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=1.0,
        seed=7,
    )
    m, c = rows(engine_proxy, "run_id = 'msg-1'")[0], rows(engine_proxy, "run_id = 'chat-1'")[0]
    assert (m["endpoint"], m["status"], m["status_code"], m["stream"]) == ("messages", "ok", 200, False)
    assert m["request"]["messages"] == c["request"]["messages"]
    assert m["prompt_token_ids"] == c["prompt_token_ids"] and m["prompt_token_ids"]
    assert m["token_ids"] == c["token_ids"] and len(m["token_ids"][0]) == msg.usage.output_tokens
    assert m["logprobs"][0] == pytest.approx(c["logprobs"][0], abs=1e-4)
    assert msg.content[0].text == chat.choices[0].message.content
    assert (m["prompt_tokens"], m["completion_tokens"]) == (msg.usage.input_tokens, msg.usage.output_tokens)
    assert m["client_request"]["metadata"] == {"user_id": "u-1"} and m["client_request"]["max_tokens"] == 8
    assert m["client_response"] == json.loads(raw.http_response.text)
    want = {"length": "max_tokens", "stop": "end_turn"}[c["finish_reason"]]
    assert msg.stop_reason == want


def test_stream_helper_and_raw_events(engine_proxy: Any) -> None:
    c = client(engine_proxy.url, "msg-s")
    with c.messages.stream(
        model="tiny", messages=[{"role": "user", "content": "Count."}], max_tokens=6, extra_body={"seed": 3}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens >= 1
    (row,) = rows(engine_proxy, "run_id = 'msg-s'")
    assert (row["endpoint"], row["status"], row["stream"]) == ("messages", "ok", True)
    assert row["response"]["choices"][0]["message"]["content"] == text
    assert len(row["token_ids"][0]) == len(row["logprobs"][0]) == final.usage.output_tokens
    assert row["client_response"]["content"][0]["text"] == text and row["client_response"]["id"] == final.id
    assert final.usage.input_tokens == len(row["prompt_token_ids"])

    # stream=True, read raw: the exact event sequence, each event parsed by the SDK's own type
    r = httpx.post(
        f"{engine_proxy.url}/v1/messages",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "stream": True,
            "seed": 3,  # unseeded, the tiny random model ends a turn within 4 tokens now and then
        },
        headers={"X-Run-Id": "msg-s2"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    body = names[2:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 4


def test_count_tokens_is_the_prompt_of_the_chat_form(engine_proxy: Any) -> None:
    c = client(engine_proxy.url, "cnt")
    kw = {"model": "tiny", "system": "Be brief.", "messages": [{"role": "user", "content": "Weather?"}]}
    count = c.messages.count_tokens(**kw, tools=[WEATHER])
    assert isinstance(count, MessageTokensCount)
    msg = c.messages.create(**kw, tools=[WEATHER], max_tokens=1)
    assert (
        count.input_tokens
        == msg.usage.input_tokens
        == len(rows(engine_proxy, "run_id = 'cnt'")[0]["prompt_token_ids"])
    )
    assert c.messages.count_tokens(**kw).input_tokens < count.input_tokens  # the tools are in the prompt
    # under a run prefix too, and counting stores nothing
    pfx = anthropic.Anthropic(base_url=f"{engine_proxy.url}/runs/cnt/", api_key="x", max_retries=0)
    assert pfx.messages.count_tokens(**kw, tools=[WEATHER]).input_tokens == count.input_tokens
    assert engine_proxy.query("SELECT count(*) FROM completions") == [(1,)]


def test_agent_cli_request_is_served_and_recorded(engine_proxy: Any) -> None:
    """What Claude Code sends: ?beta=true, anthropic-beta, system blocks with cache_control and the
    billing header, thinking adaptive, context_management, output_config, metadata.user_id holding
    JSON, and max_tokens 32000 (past the tiny model's context): served, clamped, recorded."""
    long = filling(client(engine_proxy.url), "tiny", room=300)[0]["content"]  # tools + system: ~200
    body = {
        "model": "tiny",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=abc123;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": long, "cache_control": {"type": "ephemeral"}},
                ],
            }
        ],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "metadata": {"user_id": json.dumps({"session_id": "s-1", "device_id": "d"})},
        "tools": [WEATHER],
        "stream": True,
    }
    r = httpx.post(
        f"{engine_proxy.url}/v1/messages?beta=true",
        json=body,
        headers={
            "X-Run-Id": "cli-1",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
            "context-management-2025-06-27",
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1][0] == "message_stop" and events[-2][1]["delta"]["stop_reason"] in (
        "max_tokens",
        "end_turn",
    )
    (row,) = rows(engine_proxy, "run_id = 'cli-1'")
    assert row["status"] == "ok" and row["token_ids"][0]
    assert "max_tokens" not in row["request"]  # clamped: until the context is full
    assert row["request"]["messages"][0] == {"role": "system", "content": "You are Claude Code.\nBe concise."}
    assert row["request"]["messages"][1] == {
        "role": "user",
        "content": f"<system-reminder>ctx</system-reminder>\n{long}",
    }
    assert len(row["prompt_token_ids"]) + len(row["token_ids"][0]) <= 2048
    assert row["client_request"]["max_tokens"] == 32000 and row["client_request"]["thinking"] == {
        "type": "adaptive"
    }
    assert row["client_request"]["context_management"] == body["context_management"]


def test_run_path_prefix_reward_and_default_group(engine_proxy: Any) -> None:
    c = anthropic.Anthropic(base_url=f"{engine_proxy.url}/runs/pfx-1", api_key="x", max_retries=0)
    c.messages.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    (row,) = rows(engine_proxy, "run_id = 'pfx-1'")
    assert row["endpoint"] == "messages"
    assert engine_proxy.query("SELECT group_id FROM runs WHERE id = 'pfx-1'")[0][0].startswith("g-")
    r = httpx.post(f"{engine_proxy.url}/v1/runs/pfx-1/reward", json={"reward": 1.0}, timeout=30)
    assert r.status_code == 200, r.text
    engine_proxy.flush()
    assert engine_proxy.query("SELECT status, reward FROM runs WHERE id = 'pfx-1'") == [("completed", 1.0)]


# ---------------------------------------------------------------------------------------------
# Errors: Anthropic's shape and status codes, nothing stored


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, "messages"),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                            }
                        ],
                    }
                ],
            },
            "messages[0].content[0].type",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {"type": "text", "data": "x", "media_type": "text/plain"},
                            }
                        ],
                    }
                ],
            },
            "messages[0].content[0].type",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools[0].type",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "any"},
            },
            "tool_choice",
        ),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ],
)
def test_bad_requests_are_400_in_anthropics_shape(engine_proxy: Any, body: dict, param: str) -> None:
    c = client(engine_proxy.url, "bad")
    with pytest.raises(anthropic.BadRequestError) as info:  # the SDK's raw post: it checks max_tokens itself
        c.post("/v1/messages", body={"model": "tiny", **body}, cast_to=Message)
    err = info.value
    assert err.status_code == 400 and err.body["type"] == "error"
    assert err.body["error"]["type"] == "invalid_request_error" and param in err.body["error"]["message"]
    assert engine_proxy.query("SELECT count(*) FROM completions") == [(0,)]


def test_bad_json_and_wrong_types_are_400_not_422(engine_proxy: Any) -> None:
    for content in (b"{not json", b'{"model": "tiny", "max_tokens": "5", "messages": []}', b"[]"):
        r = httpx.post(
            f"{engine_proxy.url}/v1/messages", content=content, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{engine_proxy.url}/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(
        f"{engine_proxy.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "type" not in r.json() and r.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_refusal_is_relayed_in_anthropics_shape(engine_proxy: Any, stream: bool) -> None:
    """The engine's own 400 (temperature out of range), not a context overflow: relayed with its
    message, streamed or not (the clamp check reads the refusal and must not lose it)."""
    body = {"model": "tiny", "max_tokens": 5, "messages": HI, "temperature": 5.0, "stream": stream}
    r = httpx.post(f"{engine_proxy.url}/v1/messages", json=body, headers={"X-Run-Id": "refused"}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "temperature" in r.json()["error"]["message"]
    (row,) = rows(engine_proxy, "run_id = 'refused'")
    assert (row["status"], row["status_code"]) == ("error", 400) and "temperature" in row["error"]


def test_x_api_key_is_the_agents_key(make_proxy: Any, engine_backend: Any, tiny_model_dir: Any) -> None:
    proxy = make_proxy(
        engine_backend.base_url, model=str(tiny_model_dir), api_key="agent-key", admin_key="admin-key"
    )
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=proxy.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=msgs, max_tokens=2
        )
    assert info.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
    }
    good = anthropic.Anthropic(
        base_url=proxy.url, api_key="agent-key", max_retries=0, default_headers={"X-Run-Id": "k-1"}
    )
    assert good.messages.create(model="tiny", messages=msgs, max_tokens=2).type == "message"
    assert good.messages.count_tokens(model="tiny", messages=msgs).input_tokens > 0
    # an operator route with the agents' key is 403, whichever header carries it
    r = httpx.get(f"{proxy.url}/v1/runs", headers={"x-api-key": "agent-key"})
    assert r.status_code == 403
    r = httpx.get(f"{proxy.url}/v1/runs", headers={"x-api-key": "admin-key"})
    assert r.status_code == 200
    # the key is ours: never forwarded to the upstream
    assert proxy.state.drop_headers >= {b"authorization", b"x-api-key"}


def test_limits_apply_in_anthropics_shape(make_proxy: Any, stub: Any) -> None:
    """The body limit (413, before the route) and the guard's Host check answer in Anthropic's shape."""
    proxy = make_proxy(stub.url, max_body_bytes=2048)
    c = client(proxy.url, "big")
    with pytest.raises(anthropic.APIStatusError) as info:
        c.messages.create(
            model="stub-model", max_tokens=5, messages=[{"role": "user", "content": "x" * 4096}]
        )
    assert info.value.status_code == 413
    assert info.value.body["error"]["type"] == "request_too_large"
    r = httpx.post(f"{proxy.url}/v1/messages", json={}, headers={"host": "evil.example"})
    assert r.status_code == 421 and r.json()["type"] == "error"
    assert c.messages.create(
        model="stub-model", max_tokens=5, messages=[{"role": "user", "content": "x"}]
    ).content
    assert proxy.query("SELECT count(*) FROM completions") == [(1,)]


# ---------------------------------------------------------------------------------------------
# Tool calls out of the model: a stub upstream that answers with vLLM-shaped tool calls


def test_tool_round_trip(make_proxy: Any, tool_stub: ToolStub) -> None:
    """tool_use out (non-streamed and streamed, input_json_delta), tool_result back in: the chat
    form the upstream gets, and what the SDK's types make of every answer."""
    proxy = make_proxy(tool_stub.url)
    c = client(proxy.url, "tools-1")
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    msg = c.messages.create(
        model="stub-model", messages=ask, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=50
    )
    assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.stop_reason == "tool_use"
    use = msg.content[1]
    assert (use.id, use.name, use.input) == ("chatcmpl-tool-abc", "get_weather", {"city": "Oslo"})
    sent = tool_stub.bodies[-1]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    assert sent["tool_choice"] == "required" and sent["max_tokens"] == 50

    with c.messages.stream(model="stub-model", messages=ask, tools=[WEATHER], max_tokens=50) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
    assert ("content_block_delta", "input_json_delta") in kinds and (
        "content_block_delta",
        "text_delta",
    ) in kinds
    assert final.model_dump(exclude={"id"}) == msg.model_dump(exclude={"id"}) | {
        "usage": final.usage.model_dump()
    }
    assert final.stop_reason == "tool_use" and final.usage.input_tokens == 3

    # the tool_result turn: the assistant's tool_use and the result reach the upstream as chat does it
    c.messages.create(
        model="stub-model",
        messages=[
            *ask,
            {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use.id,
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"],
        extra_body={"top_k": 5, "temperature": 0.5, "top_p": 0.9},
        max_tokens=50,
    )
    sent = tool_stub.bodies[-1]
    assert sent["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (sent["parallel_tool_calls"], sent["stop"], sent["top_k"]) == (False, ["\n\n"], 5)
    assert (sent["temperature"], sent["top_p"]) == (0.5, 0.9)
    stored = rows(proxy, "run_id = 'tools-1'")
    assert [r["stream"] for r in stored] == [False, True, False]
    assert stored[1]["token_ids"] == [[10, 11, 12, 13, 14]] and stored[1]["prompt_token_ids"] == [1, 2, 3]
    assert stored[1]["client_response"]["content"][1]["input"] == {"city": "Oslo"}


def test_upstream_breaking_mid_stream_ends_with_an_error_event(make_proxy: Any, loop_thread: Any) -> None:
    with running(loop_thread, BreakingStub()) as stub:
        proxy = make_proxy(stub.url)
        r = httpx.post(
            f"{proxy.url}/v1/messages",
            json={
                "model": "stub-model",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 9,
                "stream": True,
            },
            headers={"X-Run-Id": "broken"},
            timeout=30,
        )
        events = sse_events(r.text)
        assert events[-1][1]["type"] == "error" and events[-1][1]["error"]["type"] == "api_error"
        assert "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta") == "Hello"
        with pytest.raises(anthropic.APIStatusError):  # the SDK raises on the error event
            with client(proxy.url).messages.stream(
                model="stub-model", messages=[{"role": "user", "content": "x"}], max_tokens=9
            ) as s:
                list(s)
        row = rows(proxy, "run_id = 'broken'")[0]
        assert (row["status"], row["status_code"]) == ("error", 502) and row["token_ids"] == [[7, 7]]


# ---------------------------------------------------------------------------------------------
# Rewarded and trained like any run


def test_rewarded_messages_runs_train_on_sampled_tokens_only(
    engine_proxy: Any, tiny_model_dir: Any, tmp_path: Any
) -> None:
    """Two 2-turn Messages runs (tool_use -> tool_result in the second turn) of one group, rewarded
    1 and 0: the group is ready, every sample is the stored prompt + the sampled tokens, and a GRPO
    step trains on exactly those tokens."""
    import torch
    from oracle import build_samples, collate

    from rlproxy.storage.training import load_runs, ready_groups
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy
    from rlproxy.trainer.step import make_optimizer, train_step

    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    for i, reward in enumerate((1.0, 0.0)):
        c = client(engine_proxy.url, f"train-{i}")
        first = c.messages.create(
            model="tiny", messages=ask, tools=[WEATHER], max_tokens=4, extra_body={"seed": i}
        )
        turn = [
            *ask,
            {
                "role": "assistant",
                "content": [
                    *[b.model_dump() for b in first.content if b.type == "text" and b.text],
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
            },
        ]
        c.messages.create(
            model="tiny", messages=turn, tools=[WEATHER], max_tokens=4, extra_body={"seed": 10 + i}
        )
        r = httpx.post(f"{engine_proxy.url}/v1/runs/train-{i}/reward", json={"reward": reward}, timeout=30)
        assert r.status_code == 200, r.text
    engine_proxy.flush()
    engine = engine_proxy.state.engine
    groups = engine_proxy.lt.run(ready_groups(engine, group_size=2, group_timeout=3600))
    assert [sorted(g.run_ids) for g in groups] == [["train-0", "train-1"]]
    runs = engine_proxy.lt.run(load_runs(engine, ["train-0", "train-1"]))
    assert [[c.endpoint for c in r.completions] for r in runs] == [["messages", "messages"]] * 2

    config = TrainerConfig(
        learning_rate=5e-3, micro_batch_size=4, checkpoint_dir=str(tmp_path / "ck"), seed=0
    )
    model, tok = load_policy(str(tiny_model_dir), config)
    samples, counts = build_samples(runs, {"train-0": 1.0, "train-1": -1.0}, tok, 4096)
    stored = [(c.prompt_token_ids, c.token_ids[0], c.logprobs[0]) for r in runs for c in r.completions]
    assert counts.rebuilt == 0 and len(samples) == 4
    assert [(s.prompt_ids, s.completion_ids) for s in samples] == [(p, t) for p, t, _ in stored]
    batch = collate(samples, tok.pad_token_id)
    assert batch.num_tokens == sum(len(t) for _, t, _ in stored)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    result = train_step(model, tok, make_optimizer(model, config), runs, config)
    assert not result.skipped and result.num_runs == 2 and result.num_tokens == batch.num_tokens
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


# ---------------------------------------------------------------------------------------------
# The embedded engine serves the Messages API itself (`rlproxy engine` alone)


def test_the_engine_serves_messages_and_count_tokens(engine_backend: Any) -> None:
    c = anthropic.Anthropic(base_url=engine_backend.base_url, api_key="x", max_retries=0)
    model, hi = engine_backend.served_model, [{"role": "user", "content": "hi"}]
    long = filling(c, model)
    msg = c.messages.create(
        model=model, messages=long, max_tokens=32000, timeout=60
    )  # clamped to what is left
    assert msg.type == "message" and msg.stop_reason in ("max_tokens", "end_turn")
    used = msg.usage.input_tokens + msg.usage.output_tokens
    assert used == 2048 if msg.stop_reason == "max_tokens" else used < 2048  # up to the context's end
    with c.messages.stream(model=model, messages=hi, max_tokens=3) as s:
        final = s.get_final_message()
    assert final.usage.output_tokens == 3 and final.stop_reason == "max_tokens"
    assert c.messages.count_tokens(model=model, messages=hi).input_tokens == final.usage.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as info:
        c.post("/v1/messages", body={"model": model, "messages": hi}, cast_to=Message)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
