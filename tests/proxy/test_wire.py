"""The README's list "What changes on the wire", checked against a recording upstream.

Request: `model` becomes `{policy}@{step}` (the base model's name before step 1); `return_token_ids`
and sampling `logprobs` are added when the client did not ask for them; nothing else in the body
changes. Response: those fields come back as null, `model` names the adapter that answered, and
`X-Policy-Step` is added. The pass-through routes relay the upstream's bytes as they are.
"""

from __future__ import annotations

import httpx
import orjson
import pytest
from stub_upstream import StubUpstream


class Recording(StubUpstream):
    """The stub upstream, keeping the body of every request it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bytes, dict | None]] = []

    async def _handle(self, method, path, body, delay, w) -> None:
        self.seen.append((path, orjson.loads(body) if body else None))
        await super()._handle(method, path, body, delay, w)


@pytest.fixture
def recording(loop_thread):
    s = Recording()
    loop_thread.run(s.start())
    yield s
    loop_thread.run(s.stop())


CLIENT_BODY = {
    "model": "gpt-4o-mini",  # served through RLPROXY_MODEL_MAP='*=stub-model'
    "messages": [{"role": "user", "content": "héllo"}],
    "temperature": 0.7,
    "max_tokens": 5,
    "metadata": {"anything": ["the", "client", "sends"]},
    "x_unknown_field": 1,
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_what_changes_on_the_wire(make_proxy, recording, loop_thread, stream):
    proxy = make_proxy(recording.url, model_map="*=stub-model")
    body = {**CLIENT_BODY, "stream": stream}

    resp = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Run-Id": "w-1"})
    assert resp.status_code == 200 and resp.headers["x-policy-step"] == "0"
    path, sent = recording.seen[-1]
    assert path == b"/v1/chat/completions"
    # the request: model rewritten, two capture fields added, everything else as the client sent it
    assert sent == {**body, "model": "stub-model", "return_token_ids": True, "logprobs": True}

    loop_thread.run(proxy.state.policies.set_step("stub-model", 5))  # as the trainer does after a step
    resp = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Run-Id": "w-2"})
    assert resp.headers["x-policy-step"] == "5"
    assert recording.seen[-1][1]["model"] == "stub-model@5"
    chunks = (
        [orjson.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        if stream
        else [resp.json()]
    )
    assert chunks
    for chunk in chunks:  # the response: the injected fields are null, `model` names the adapter
        assert chunk["model"] == "stub-model@5"
        assert chunk.get("prompt_token_ids") is None
        for choice in chunk["choices"]:
            assert choice.get("token_ids") is None and choice.get("logprobs") is None
    # ... while the store keeps them
    assert proxy.query("SELECT policy, adapter, policy_step, token_ids IS NOT NULL FROM completions") == [
        ("stub-model", "stub-model", 0, 1),
        ("stub-model", "stub-model@5", 5, 1),
    ]


def test_fields_the_client_asked_for_are_untouched(make_proxy, recording):
    proxy = make_proxy(recording.url)
    body = {
        **CLIENT_BODY,
        "model": "stub-model",
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }
    resp = httpx.post(f"{proxy.url}/v1/chat/completions", json=body).json()
    assert recording.seen[-1][1] == body
    assert resp["prompt_token_ids"] and resp["choices"][0]["token_ids"] and resp["choices"][0]["logprobs"]


def test_pass_through_relays_bytes(make_proxy, recording):
    proxy = make_proxy(recording.url)
    direct = httpx.get(f"{recording.url}/v1/models")
    via = httpx.get(f"{proxy.url}/v1/models")
    assert via.content == direct.content and "x-policy-step" not in via.headers
