"""Hosted upstreams (issue 25): a policy served by a text-only provider, beside a trainable one.

The provider is demo/provider.py's stand-in, strict as OpenAI is (400 on any field it does not know,
401 without its key); the trainable policy is the vLLM-like stub. Through the real openai SDK: every
turn stored with its messages and tool calls, token ids NULL and `source = 'hosted'`, zero 400s;
the provider's failures reach the client as the provider gave them (429 with its Retry-After).
On the old code the proxy added `return_token_ids` and every hosted call was a 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from rlproxy.demo.directory import TOOLS, expert
from rlproxy.demo.provider import Provider, ProviderServer
from rlproxy.errors import ConfigError
from rlproxy.proxy.hosted import HostedSpec, parse_hosted
from rlproxy.proxy.policies import Policies

KEY = "sk-provider-secret"
QUESTION = [
    {"role": "system", "content": "Look people up."},
    {"role": "user", "content": "What are the phone extensions of Alice and Frank?"},
]


@pytest.fixture
def provider() -> Iterator[Provider]:
    p = Provider(expert, api_key=KEY, model="hosted-expert")
    server = ProviderServer(p).start()
    p.url = server.url  # type: ignore[attr-defined]
    yield p
    server.stop()


@pytest.fixture
def proxy(make_proxy: Any, stub: Any, provider: Provider) -> Any:
    """student = the stub's base model (trainable, exact tokens); teacher = the hosted provider;
    the app's hard-coded `gpt-4o-mini` goes to the teacher."""
    return make_proxy(
        stub.url,
        hosted_upstreams=f"teacher={provider.url}",  # type: ignore[attr-defined]
        hosted_models="teacher=hosted-expert",
        upstream_api_key=KEY,
        model_map="gpt-4o-mini=teacher",
    )


def _client(proxy: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="agents-key", max_retries=0)


def test_every_turn_stored_text_only_and_marked(proxy: Any, provider: Provider) -> None:
    client = _client(proxy)
    headers = {"X-Run-Id": "teach-1"}
    # tools, not streaming: the provider's tool call reaches the client as it sent it
    first = client.chat.completions.create(
        model="gpt-4o-mini", messages=QUESTION, tools=TOOLS, temperature=0.2, extra_headers=headers
    )
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"name": "Alice"}
    assert first.model == "hosted-expert" and first.usage.prompt_tokens > 0
    # tools, streaming: assembled by the SDK from the relayed chunks
    history = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True)]
    history.append(
        {"role": "tool", "tool_call_id": call.id, "content": '{"name": "Alice", "extension": "4821"}'}
    )
    stream = client.chat.completions.create(
        model="teacher", messages=history, tools=TOOLS, stream=True, extra_headers=headers
    )
    chunks = list(stream)
    args = "".join(
        tc.function.arguments or ""
        for c in chunks
        for tc in (c.choices[0].delta.tool_calls or [])
        if c.choices
    )
    assert json.loads(args) == {"name": "Frank"}
    # no tools, streaming and not
    plain = client.chat.completions.create(model="teacher", messages=QUESTION[1:], extra_headers=headers)
    assert plain.choices[0].message.tool_calls
    text = client.chat.completions.create(
        model="teacher",
        messages=[
            *history,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"name": "Frank"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c2", "content": '{"name": "Frank", "extension": "3307"}'},
        ],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
    )
    pieces = list(text)
    answer = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert answer == "Alice: 4821, Frank: 3307" and pieces[-1].usage is not None

    # the provider got the requests as the client wrote them: no capture fields, model mapped, its key,
    # and none of rlproxy's run headers
    assert len(provider.requests) == 4
    for body, sent in zip(provider.requests, provider.headers, strict=True):
        assert "return_token_ids" not in body and "logprobs" not in body
        assert body["model"] == "hosted-expert"
        assert sent["authorization"] == f"Bearer {KEY}" and "x-run-id" not in sent
    assert provider.requests[0]["temperature"] == 0.2 and provider.requests[0]["tools"] == TOOLS

    rows = proxy.query(
        "SELECT seq, policy, adapter, source, status, status_code, prompt_token_ids, token_ids, logprobs, "
        "prompt_tokens, completion_tokens, stream FROM completions WHERE run_id = 'teach-1' ORDER BY seq"
    )
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    for seq, policy, adapter, source, status, code, pids, ids, lps, ptok, ctok, streamed in rows:
        assert (policy, adapter, source, status, code) == ("teacher", "hosted-expert", "hosted", "ok", 200)
        assert pids is None and ids is None and lps is None, seq
        if streamed and seq == 1:  # a stream without include_usage: the provider counted nothing for us
            assert ptok is None and ctok is None
        else:
            assert ptok > 0 and ctok > 0
    # the messages view shows the tool calls, streamed or not
    calls = proxy.query(
        "SELECT seq, tool_calls FROM messages WHERE run_id = 'teach-1' AND role = 'assistant' "
        "AND idx = (SELECT MAX(idx) FROM messages m2 WHERE m2.completion_id = messages.completion_id) "
        "ORDER BY seq"
    )
    assert [json.loads(tc)[0]["function"]["name"] for _, tc in calls[:3]] == ["lookup"] * 3
    stored = proxy.query("SELECT response FROM completions WHERE run_id = 'teach-1' AND seq = 1")[0][0]
    assert "token_ids" not in json.loads(stored)["choices"][0]


def test_trainable_policy_keeps_exact_tokens(proxy: Any, stub: Any) -> None:
    """Two policies, two upstreams: the student's calls still go to the backend with capture fields."""
    client = _client(proxy)
    client.chat.completions.create(model="stub-model", messages=QUESTION, extra_headers={"X-Run-Id": "stu-1"})
    row = proxy.query("SELECT policy, source, token_ids IS NOT NULL FROM completions WHERE run_id = 'stu-1'")
    assert row == [("stub-model", None, 1)]


def test_provider_failures_reach_the_client(proxy: Any, provider: Provider) -> None:
    client = _client(proxy)
    headers = {"X-Run-Id": "fail-1"}
    # 429 with Retry-After, as the provider sent it (an SDK with retries would wait that long)
    provider.fail_next.append((429, {"retry-after": "7", "x-ratelimit-remaining-requests": "0"}))
    with pytest.raises(openai.RateLimitError) as exc:
        client.chat.completions.create(model="teacher", messages=QUESTION, extra_headers=headers)
    assert exc.value.response.headers["retry-after"] == "7"
    assert exc.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    # the same for a stream
    provider.fail_next.append((429, {"retry-after": "3"}))
    with pytest.raises(openai.RateLimitError) as exc:
        client.chat.completions.create(model="teacher", messages=QUESTION, stream=True, extra_headers=headers)
    assert exc.value.response.headers["retry-after"] == "3"
    # 5xx and 401 (rlproxy's key for the provider is wrong), relayed with the provider's body
    provider.fail_next.append((503, {}))
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="teacher", messages=QUESTION, extra_headers=headers)
    provider.fail_next.append((401, {}))
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="teacher", messages=QUESTION, extra_headers=headers)
    # a stream the provider cuts: the client's stream is cut too, stored as an error
    provider.cut_after = 2
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        list(
            client.chat.completions.create(
                model="teacher", messages=QUESTION, stream=True, extra_headers=headers
            )
        )
    rows = proxy.query(
        "SELECT seq, source, status, status_code, token_ids FROM completions "
        "WHERE run_id = 'fail-1' ORDER BY seq"
    )
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("hosted", "error", 429),
        ("hosted", "error", 429),
        ("hosted", "error", 503),
        ("hosted", "error", 401),
        ("hosted", "error", 502),
    ]
    assert all(r[4] is None for r in rows)
    # the provider's answer was the only source of those statuses: nothing the proxy sent was refused
    assert not any("return_token_ids" in b for b in provider.requests)


def test_hosted_settings() -> None:
    specs = parse_hosted("teacher=https://api.openai.com/v1", "teacher=gpt-4o-mini", "", "sk-x")
    assert specs == {"teacher": HostedSpec("teacher", "https://api.openai.com/v1", "gpt-4o-mini", "sk-x")}
    assert specs["teacher"].root == "https://api.openai.com"
    assert (
        parse_hosted("t=https://api.fireworks.ai/inference/v1")["t"].root
        == "https://api.fireworks.ai/inference"
    )
    with pytest.raises(ConfigError):
        parse_hosted("teacher=ftp://x")
    with pytest.raises(ConfigError):
        parse_hosted("teacher=http://x", api_keys="teacher=RLPROXY_TEST_UNSET_KEY")
    with pytest.raises(ConfigError):
        parse_hosted("teacher=http://x", models="other=m")


def test_policy_routing_with_a_hosted_teacher() -> None:
    """An app moves from teacher to student by the model map alone; the teacher has no steps."""
    on_teacher = Policies("base", "gpt-4o-mini=teacher", text_only={"teacher": None})
    assert on_teacher.resolve("gpt-4o-mini") == ("teacher", 0, "gpt-4o-mini")  # the client's name, as written
    assert on_teacher.resolve("teacher") == ("teacher", 0, "teacher")
    named = Policies("base", "", text_only={"teacher": "gpt-4o"})
    assert named.resolve("teacher") == ("teacher", 0, "gpt-4o")
    on_student = Policies("base", "gpt-4o-mini=student", text_only={"teacher": None})
    on_student.steps["student"] = 4
    assert on_student.resolve("gpt-4o-mini") == ("student", 4, "student@4")
