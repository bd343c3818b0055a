"""The proxy in front of the real vLLM server: what the client gets is what vLLM would have sent.

vLLM is the upstream whose shapes the capture mirrors exactly (unrequested capture fields as explicit
nulls, no empty token chunks), so here responses are compared as they are, without normalizing.
"""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _without_ids(obj):
    """Without what differs by design: the reply id and time, and the `token_ids` / `prompt_token_ids`
    keys vLLM writes as null when not asked for them (the proxy asks, then leaves them out: an
    answer carries no non-standard field the client did not ask for)."""
    if isinstance(obj, list):
        return [_without_ids(x) for x in obj]
    if isinstance(obj, dict):
        return {
            k: _without_ids(v)
            for k, v in obj.items()
            if k not in ("id", "created") and not (k in ("token_ids", "prompt_token_ids") and v is None)
        }
    return obj


def _opening(chunk: dict) -> dict:
    """A stream chunk without its text (a completion's `text`, a chat delta's `content`) and without
    what only a stream's last chunk carries (`finish_reason`, `stop_reason`, `system_fingerprint`):
    when vLLM runs ahead of its reader the whole answer can come as one chunk, first and last at once."""
    choices = []
    for c in chunk["choices"]:
        c = {k: v for k, v in c.items() if k not in ("text", "finish_reason", "stop_reason")}
        if isinstance(c.get("delta"), dict):
            c["delta"] = {k: v for k, v in c["delta"].items() if k != "content"}
        choices.append(c)
    return {**{k: v for k, v in chunk.items() if k != "system_fingerprint"}, "choices": choices}


@pytest.fixture
def vllm_proxy(make_proxy, vllm_backend, tiny_model_dir):
    return make_proxy(vllm_backend.base_url, model="tiny")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_same_seed_same_response_and_exact_tokens(vllm_proxy, vllm_backend, tiny_tokenizer, endpoint, stream):
    via = openai.OpenAI(base_url=f"{vllm_proxy.url}/v1", api_key="x", max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=f"{vllm_backend.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    kwargs = dict(model="tiny", max_tokens=8, seed=13, temperature=1.0, stream=stream)
    run = f"vllm-{endpoint}-{stream}"

    def call(client, **extra):
        if endpoint == "chat":
            r = client.chat.completions.with_raw_response.create(messages=MESSAGES, **kwargs, **extra)
        else:
            r = client.completions.with_raw_response.create(prompt="Colours:", **kwargs, **extra)
        if stream:
            body = r.http_response.read().decode()
            return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        return r.http_response.json()

    got = call(via, extra_headers={"X-Run-Id": run})
    want = call(direct)
    if not stream:
        assert _without_ids(got) == _without_ids(want)
    else:
        # vLLM merges tokens into one chunk when it runs ahead of the reader, so chunk boundaries
        # vary from call to call (the first chunk's text too: "many" vs "manyRead letter"):
        # compare the text, the first chunk but its text, the last chunk's end, the leak check.
        assert _text(got, endpoint) == _text(want, endpoint)
        assert _opening(_without_ids(got[0])) == _opening(_without_ids(want[0]))
        (end,), (want_end,) = got[-1]["choices"], want[-1]["choices"]
        assert end["finish_reason"] == want_end["finish_reason"]
        assert end.get("stop_reason") == want_end.get("stop_reason")
        assert got[-1].get("system_fingerprint") == want[-1].get("system_fingerprint")
        for chunk in got:
            assert chunk.get("prompt_token_ids") is None
            assert all(c.get("token_ids") is None and c.get("logprobs") is None for c in chunk["choices"])

    ((token_ids, logprobs, status),) = vllm_proxy.query(
        "SELECT token_ids, logprobs, status FROM completions WHERE run_id = ?", run
    )
    token_ids, logprobs = json.loads(token_ids)[0], json.loads(logprobs)[0]
    assert status == "ok" and len(token_ids) == len(logprobs) > 0
    assert tiny_tokenizer.decode(token_ids, skip_special_tokens=True) == _text(got, endpoint)


def _text(got, endpoint: str) -> str:
    if isinstance(got, list):  # stream chunks
        if endpoint == "chat":
            return "".join(c["choices"][0]["delta"].get("content") or "" for c in got if c.get("choices"))
        return "".join(c["choices"][0]["text"] for c in got if c.get("choices"))
    choice = got["choices"][0]
    return choice["message"]["content"] if endpoint == "chat" else choice["text"]
