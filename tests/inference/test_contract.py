"""The backend contract, driven by the real `openai` SDK against both backends.

Both the embedded engine and vLLM must pass the same assertions: the proxy and the trainer rely on
exactly these behaviours (token ids that decode to the text, raw logprobs, adapters by name, vLLM's
error statuses). The "vllm" half uses the session fixture `vllm_backend` from tests/conftest.py and
skips when that fixture does not exist yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(params=["embedded", "vllm"])
def backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "embedded":
        return request.getfixturevalue("embedded_backend")
    try:
        return request.getfixturevalue("vllm_backend")
    except pytest.FixtureLookupError:
        pytest.skip("no vllm_backend fixture in this checkout")


@pytest.fixture
def client(backend: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{backend.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, backend: Any, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": backend.served_model, "messages": PROMPT, "max_tokens": 12, "seed": 7}
    args.update(kw)
    return client.chat.completions.create(**args)


def test_models_lists_the_base_model(client: openai.OpenAI, backend: Any) -> None:
    ids = [m.id for m in client.models.list().data]
    assert backend.served_model in ids


def test_plain_chat(client: openai.OpenAI, backend: Any) -> None:
    r = chat(client, backend)
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_matches_the_same_seeded_request(client: openai.OpenAI, backend: Any) -> None:
    whole = chat(client, backend, temperature=0.0)
    chunks = list(chat(client, backend, temperature=0.0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finish == [whole.choices[0].finish_reason]
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )


def test_n2_gives_two_choices(client: openai.OpenAI, backend: Any) -> None:
    r = chat(client, backend, n=2, temperature=1.0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.role == "assistant" for c in r.choices)
    assert r.usage.completion_tokens >= 2


def test_chat_logprobs_are_raw_and_per_token(client: openai.OpenAI, backend: Any) -> None:
    r = chat(
        client, backend, logprobs=True, top_logprobs=2, temperature=1.5, extra_body={"return_token_ids": True}
    )
    c = r.choices[0]
    entries = c.logprobs.content
    assert len(entries) == len(c.token_ids) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0.0 and len(e.top_logprobs) == 2
        # raw distribution: the best alternative is at least as likely as the sampled token
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-4


def test_return_token_ids_decode_to_the_text(
    client: openai.OpenAI, backend: Any, tiny_tokenizer: Any
) -> None:
    r = chat(client, backend, max_tokens=16, extra_body={"return_token_ids": True})
    body = r.model_dump()
    assert isinstance(body["prompt_token_ids"], list) and body["prompt_token_ids"]
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == r.usage.completion_tokens
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == r.choices[0].message.content
    assert "France" in tiny_tokenizer.decode(body["prompt_token_ids"])


def test_return_token_ids_streamed(client: openai.OpenAI, backend: Any, tiny_tokenizer: Any) -> None:
    chunks = [
        ch.model_dump()
        for ch in chat(client, backend, max_tokens=16, stream=True, extra_body={"return_token_ids": True})
    ]
    assert chunks[0]["prompt_token_ids"]
    ids = [t for ch in chunks for c in ch["choices"] for t in (c.get("token_ids") or [])]
    text = "".join((c["delta"].get("content") or "") for ch in chunks for c in ch["choices"])
    assert ids and tiny_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_completions_plain_stream_logprobs_and_token_ids(
    client: openai.OpenAI, backend: Any, tiny_tokenizer: Any
) -> None:
    args = {
        "model": backend.served_model,
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "seed": 3,
        "logprobs": 1,
        "extra_body": {"return_token_ids": True},
    }
    r = client.completions.create(**args).model_dump()
    c = r["choices"][0]
    assert c["prompt_token_ids"] == tiny_tokenizer.encode("The capital of France is")
    assert tiny_tokenizer.decode(c["token_ids"], skip_special_tokens=True) == c["text"]
    assert len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"])
    chunks = [ch.model_dump() for ch in client.completions.create(stream=True, **args)]
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    ids = [t for ch in chunks for ch_c in ch["choices"] for t in (ch_c.get("token_ids") or [])]
    assert text == c["text"] and ids == c["token_ids"]


def test_tools_reach_the_prompt_and_the_answer_is_well_formed(
    client: openai.OpenAI, backend: Any, tiny_tokenizer: Any
) -> None:
    r = chat(
        client,
        backend,
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=8,
        extra_body={"return_token_ids": True},
    )
    prompt = tiny_tokenizer.decode(r.model_dump()["prompt_token_ids"])
    assert "get_weather" in prompt and "<tool_call>" in prompt
    c = r.choices[0]
    # the tiny model is random: it may or may not call the tool, but the shape must be OpenAI's
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        json.loads(c.message.tool_calls[0].function.arguments)
    else:
        assert c.finish_reason in ("stop", "length")


def backend_kind(backend: Any) -> str:
    return "embedded" if type(backend).__name__ == "EmbeddedBackend" else "vllm"


def _post(backend: Any, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{backend.base_url}/v1/{route}", json=body, timeout=60)


def test_adapter_changes_output_and_unload_gives_404(
    client: openai.OpenAI, backend: Any, lora_dirs: dict[str, Path]
) -> None:
    name = "contract-a"
    r = _post(backend, "load_lora_adapter", {"lora_name": name, "lora_path": str(lora_dirs["a"])})
    assert r.status_code == 200, r.text
    try:
        assert name in [m.id for m in client.models.list().data]
        kw = {
            "max_tokens": 12,
            "temperature": 0.0,
            "extra_body": {"return_token_ids": True, "ignore_eos": True},
        }
        base = chat(client, backend, **kw).model_dump()["choices"][0]["token_ids"]
        tuned = chat(client, backend, model=name, **kw).model_dump()["choices"][0]["token_ids"]
        assert tuned != base
        # loading the same name again needs load_inplace
        again = _post(backend, "load_lora_adapter", {"lora_name": name, "lora_path": str(lora_dirs["b"])})
        assert again.status_code == 400
        inplace = _post(
            backend,
            "load_lora_adapter",
            {"lora_name": name, "lora_path": str(lora_dirs["b"]), "load_inplace": True},
        )
        assert inplace.status_code == 200, inplace.text
    finally:
        assert _post(backend, "unload_lora_adapter", {"lora_name": name}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        chat(client, backend, model=name)
    assert _post(backend, "unload_lora_adapter", {"lora_name": name}).status_code == 404


def test_adapter_errors(backend: Any, lora_dirs: dict[str, Path], tmp_path: Path) -> None:
    missing = _post(
        backend, "load_lora_adapter", {"lora_name": "ghost", "lora_path": str(tmp_path / "nothing")}
    )
    assert missing.status_code == 404 and "error" in missing.json()
    other = _post(backend, "load_lora_adapter", {"lora_name": "other", "lora_path": str(lora_dirs["other"])})
    # the issue asks for 400; vLLM 0.32 itself answers 500 ("Call to add_lora method failed")
    assert other.status_code in ((400,) if backend_kind(backend) == "embedded" else (400, 500)), other.text
    assert "error" in other.json()
    assert _post(backend, "unload_lora_adapter", {"lora_name": "never-loaded"}).status_code == 404


def test_bad_requests_do_not_kill_the_server(client: openai.OpenAI, backend: Any) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        chat(client, backend, model="no-such-model")
    assert err.value.status_code == 404
    with pytest.raises(openai.BadRequestError):
        chat(client, backend, temperature=-1.0)
    with pytest.raises(openai.BadRequestError):
        chat(client, backend, logprobs=True, top_logprobs=1000)
    bad_json = httpx.post(
        f"{backend.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert bad_json.status_code == 400
    assert set(bad_json.json()["error"]) >= {"message", "type", "param", "code"}
    assert chat(client, backend).choices[0].message.role == "assistant"
