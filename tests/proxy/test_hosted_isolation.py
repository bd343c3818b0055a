"""Hosted policies stay with their provider (issue 55): a Messages call the provider refuses for
context length is answered with that refusal, never sent again to the local engine; `count_tokens`
for a hosted policy asks the provider (the documented 502 when it has no `/tokenize`), never the
engine; and only an allowlist of the client's headers reaches the provider, under the operator's key.

Two stubs that record what they are sent: the engine (the trainable policy's upstream) and the
provider. On the old code the refused call went to the engine (its text stored as `source hosted`),
`count_tokens` asked the engine's `/tokenize`, and `Cookie`, `OpenAI-Organization`,
`X-Forwarded-For` reached the provider.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

KEY = "sk-operator-key"
CONTEXT = orjson.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 128000 tokens. However, you requested "
            "140000 tokens. Please reduce the length of the messages or completion.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
)
ASK = {
    "model": "teacher",
    "max_tokens": 32000,
    "messages": [{"role": "user", "content": "hello"}],
}


@pytest.fixture
def provider(loop_thread: Any) -> Iterator[Any]:
    from stub_upstream import StubUpstream

    s = StubUpstream(record=True)
    loop_thread.run(s.start())
    yield s
    loop_thread.run(s.stop())


@pytest.fixture
def engine(loop_thread: Any) -> Iterator[Any]:
    from stub_upstream import StubUpstream

    s = StubUpstream(record=True)
    loop_thread.run(s.start())
    yield s
    loop_thread.run(s.stop())


@pytest.fixture
def proxy(make_proxy: Any, engine: Any, provider: Any) -> Any:
    return make_proxy(
        engine.url,
        hosted_upstreams=f"teacher={provider.url}/v1",
        hosted_models="teacher=gpt-4o-mini",
        upstream_api_key=KEY,
    )


def _chat_calls(stub: Any) -> list[tuple]:
    return [s for s in stub.seen if s[1].endswith(b"/chat/completions")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_hosted_messages_call_never_reaches_the_engine(
    proxy: Any, engine: Any, provider: Any, stream: bool
) -> None:
    provider.fail_next.append((400, CONTEXT))
    r = httpx.post(f"{proxy.url}/v1/messages", json={**ASK, "stream": stream}, headers={"X-Run-Id": "ctx-1"})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and "maximum context length" in body["error"]["message"]
    assert len(_chat_calls(provider)) == 1  # asked once, not again without max_tokens
    assert _chat_calls(engine) == []  # and never the engine
    rows = proxy.query("SELECT policy, source, status, status_code FROM completions WHERE run_id = 'ctx-1'")
    assert rows == [("teacher", "hosted", "error", 400)]


def test_count_tokens_of_a_hosted_policy_asks_the_provider(proxy: Any, engine: Any, provider: Any) -> None:
    r = httpx.post(f"{proxy.url}/v1/messages/count_tokens", json={k: ASK[k] for k in ("model", "messages")})
    assert r.status_code == 502, r.text  # the stub provider has no /tokenize (docs/anthropic.md)
    assert [s[1] for s in provider.seen] == [b"/tokenize"]
    assert provider.seen[0][2][b"authorization"] == f"Bearer {KEY}".encode()
    assert orjson.loads(provider.seen[0][3])["model"] == "gpt-4o-mini"
    assert not any(s[1] == b"/tokenize" for s in engine.seen)


def test_only_allowlisted_client_headers_reach_the_provider(proxy: Any, provider: Any) -> None:
    sent = {
        "Cookie": "session=secret",
        "OpenAI-Organization": "org-someone-else",
        "OpenAI-Project": "proj-someone-else",
        "X-Forwarded-For": "10.1.2.3",
        "Forwarded": "for=10.1.2.3",
        "Authorization": "Bearer the-clients-own-key",
        "x-api-key": "the-clients-own-key",
        "X-Stainless-OS": "Linux",
        "X-Run-Id": "hdr-1",
        "User-Agent": "OpenAI/Python 1.99",
        "Idempotency-Key": "retry-7",
        "OpenAI-Beta": "assistants=v2",
    }
    body = {"model": "teacher", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=sent).status_code == 200
    httpx.post(f"{proxy.url}/v1/messages", json=ASK, headers=sent).raise_for_status()
    calls = _chat_calls(provider)
    assert len(calls) == 2
    for _, _, headers, _ in calls:
        got = {k.decode() for k in headers}
        assert got <= {
            "host",
            "content-length",
            "content-type",
            "accept",
            "accept-encoding",
            "user-agent",
            "idempotency-key",
            "openai-beta",
            "authorization",
        }, got
        assert headers[b"authorization"] == f"Bearer {KEY}".encode()
        assert headers[b"user-agent"] == b"OpenAI/Python 1.99" and headers[b"idempotency-key"] == b"retry-7"
