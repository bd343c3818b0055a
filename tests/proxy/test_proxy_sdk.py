"""The real openai SDK through the proxy to the embedded engine on the tiny model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _client(base: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", default_headers=headers or None, max_retries=0)


_CAPTURE_KEYS = ("prompt_token_ids", "token_ids")


def _norm(obj):
    """Without id/created, and without capture keys whose value is null.

    vLLM sends unrequested `prompt_token_ids`/`token_ids` as explicit nulls (the proxy's stripped
    output mirrors that); the embedded engine omits them. Both mean "not asked".
    """
    if isinstance(obj, list):
        return [_norm(x) for x in obj]
    if isinstance(obj, dict):
        return {
            k: _norm(v)
            for k, v in obj.items()
            if k not in ("id", "created") and not (k in _CAPTURE_KEYS and v is None)
        }
    return obj


def _same(a: dict, b: dict) -> bool:
    """Equal apart from id/created and capture keys that are null on one side and absent on the other."""
    return _norm(a) == _norm(b)


def test_sync_chat_matches_direct_and_stores_tokens(engine_proxy, engine_backend, tiny_tokenizer):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7)
    via = _client(engine_proxy.url, **{"X-Run-Id": "sdk-1"}).chat.completions.with_raw_response.create(
        **kwargs
    )
    direct = _client(engine_backend.base_url).chat.completions.create(**kwargs)
    assert via.headers["x-policy-step"] == "0"
    got = via.parse()
    assert _norm(got.model_dump()) == _norm(direct.model_dump())
    # the capture fields the proxy injected are not leaked to the client
    raw = json.loads(via.http_response.text)
    assert "token_ids" not in via.http_response.text  # no `"token_ids": null` either (issue 56)
    assert raw["choices"][0]["logprobs"] is None

    rows = engine_proxy.query(
        "SELECT token_ids, prompt_token_ids, logprobs, status, seq, adapter, policy_step FROM completions"
        " WHERE run_id = 'sdk-1'"
    )
    assert len(rows) == 1
    token_ids, prompt_ids, logprobs, status, seq, adapter, step = rows[0]
    token_ids, logprobs = json.loads(token_ids), json.loads(logprobs)
    assert (status, seq, adapter, step) == ("ok", 0, "tiny", 0)
    assert len(token_ids[0]) == len(logprobs[0]) == got.usage.completion_tokens
    assert all(lp <= 0.0 for lp in logprobs[0])
    assert len(json.loads(prompt_ids)) == got.usage.prompt_tokens
    text = tiny_tokenizer.decode(token_ids[0], skip_special_tokens=True)
    assert text == got.choices[0].message.content


def test_client_asked_for_token_ids_and_logprobs_gets_them(engine_proxy, engine_backend):
    kwargs = dict(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        seed=3,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    via = _client(engine_proxy.url).chat.completions.create(**kwargs)
    direct = _client(engine_backend.base_url).chat.completions.create(**kwargs)
    assert _norm(via.model_dump()) == _norm(direct.model_dump())
    assert via.choices[0].logprobs is not None and via.choices[0].logprobs.content
    assert via.model_extra.get("prompt_token_ids")


async def test_async_stream_matches_direct_and_is_assembled(engine_proxy, engine_backend, tiny_tokenizer):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, seed=11, stream=True)
    via = openai.AsyncOpenAI(base_url=f"{engine_proxy.url}/v1", api_key="x", max_retries=0)
    direct = openai.AsyncOpenAI(base_url=f"{engine_backend.base_url}/v1", api_key="x", max_retries=0)
    got = [
        c.model_dump()
        async for c in await via.chat.completions.create(extra_headers={"X-Run-Id": "stream-1"}, **kwargs)
    ]
    want = [c.model_dump() async for c in await direct.chat.completions.create(**kwargs)]
    assert [_norm(c) for c in got] == [_norm(c) for c in want]
    for c in got:  # nothing injected leaks into the chunks
        assert c.get("prompt_token_ids") is None
        assert all(ch.get("token_ids") is None and ch.get("logprobs") is None for ch in c["choices"])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in got if c["choices"])
    ((response, token_ids, logprobs, status, ttft, ctoks),) = engine_proxy.query(
        "SELECT response, token_ids, logprobs, status, ttft_ms, completion_tokens FROM completions"
        " WHERE run_id = 'stream-1'"
    )
    response, token_ids, logprobs = json.loads(response), json.loads(token_ids), json.loads(logprobs)
    assert status == "ok" and ttft is not None and ttft > 0
    assert response["choices"][0]["message"]["content"] == text
    assert ctoks == len(token_ids[0]) == len(logprobs[0]) > 0
    assert tiny_tokenizer.decode(token_ids[0], skip_special_tokens=True) == text


def test_tools_and_n2(engine_proxy, engine_backend):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, seed=5, n=2, tools=TOOLS, temperature=1.0)
    via = _client(engine_proxy.url, **{"X-Run-Id": "n2"}).chat.completions.create(**kwargs)
    direct = _client(engine_backend.base_url).chat.completions.create(**kwargs)
    assert len(via.choices) == 2
    assert _norm(via.model_dump()) == _norm(direct.model_dump())
    ((request, token_ids),) = engine_proxy.query(
        "SELECT request, token_ids FROM completions WHERE run_id = 'n2'"
    )
    assert json.loads(request)["tools"] == TOOLS
    assert len(json.loads(token_ids)) == 2


def test_stream_n2_assembles_both_choices(engine_proxy):
    stream = _client(engine_proxy.url, **{"X-Run-Id": "sn2"}).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, seed=2, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    ((response, token_ids),) = engine_proxy.query(
        "SELECT response, token_ids FROM completions WHERE run_id = 'sn2'"
    )
    choices = json.loads(response)["choices"]
    assert [c["message"]["content"] for c in choices] == [texts[0], texts[1]]
    assert len(json.loads(token_ids)) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_completions_endpoint(engine_proxy, engine_backend, tiny_tokenizer, stream):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=8, seed=4, stream=stream)
    via = _client(engine_proxy.url, **{"X-Run-Id": "cmp"}).completions.create(**kwargs)
    direct = _client(engine_backend.base_url).completions.create(**kwargs)
    if stream:
        via = [_norm(c.model_dump()) for c in via]
        direct = [_norm(c.model_dump()) for c in direct]
        assert via == direct
        text = "".join(c["choices"][0]["text"] for c in via if c["choices"])
    else:
        assert _norm(via.model_dump()) == _norm(direct.model_dump())
        text = via.choices[0].text
        assert via.choices[0].logprobs is None
    ((token_ids, logprobs, endpoint),) = engine_proxy.query(
        "SELECT token_ids, logprobs, endpoint FROM completions WHERE run_id = 'cmp'"
    )
    assert endpoint == "completions"
    assert tiny_tokenizer.decode(json.loads(token_ids)[0], skip_special_tokens=True) == text
    assert len(json.loads(logprobs)[0]) == len(json.loads(token_ids)[0])


def test_run_path_prefix_and_models_passthrough(engine_proxy, engine_backend):
    client = openai.OpenAI(base_url=f"{engine_proxy.url}/runs/prefixed-1/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert engine_proxy.query("SELECT seq FROM completions WHERE run_id = 'prefixed-1' ORDER BY seq") == [
        (0,),
        (1,),
    ]
    via = [m.id for m in client.models.list()]
    direct = [m.id for m in _client(engine_backend.base_url).models.list()]
    assert via == direct and "tiny" in via


def test_no_run_key_is_stored_with_null_run(engine_proxy):
    _client(engine_proxy.url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert engine_proxy.query("SELECT count(*) FROM completions WHERE run_id IS NULL") == [(1,)]
    assert engine_proxy.query("SELECT count(*) FROM runs") == [(0,)]


def test_stream_chunks_carry_no_token_id_keys(engine_proxy):
    """The raw SSE bytes: the injected token ids are taken out of every chunk, keys and all."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{engine_proxy.url}/v1/chat/completions", json=body, timeout=60) as r:
        raw = r.read()
    assert r.status_code == 200 and raw.count(b"data: ") > 2
    assert b"token_ids" not in raw
