"""Pure parts of the embedded engine: detokenizing with stop strings, hermes tool calls, sampling.

The tool-call path of the HTTP app is also checked end to end here with a scripted engine (the tiny
model is random and cannot be asked to call a tool), since what is under test is the app's parsing.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from rlproxy.inference.engine import GenRequest, RowDelta
from rlproxy.inference.sampling import SamplingParams, make_generator, sample, token_logprob
from rlproxy.inference.server import create_engine_app
from rlproxy.inference.textstream import TextStream
from rlproxy.inference.tools import ToolStream, messages_for_template, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_textstream_holds_back_possible_stop_strings(tiny_tokenizer: Any) -> None:
    ids = tiny_tokenizer.encode("hello world, the end")
    ts = TextStream(tiny_tokenizer, stop=["the end"])
    out, hit = "", None
    for t in ids:
        delta, hit = ts.push(t)
        out += delta
        if hit:
            break
    assert hit == "the end" and out == "hello world, "


def test_textstream_flushes_everything_at_the_end(tiny_tokenizer: Any) -> None:
    ids = tiny_tokenizer.encode("plain text")
    ts = TextStream(tiny_tokenizer, stop=["zzzz"])
    out = "".join(ts.push(t, final=i == len(ids) - 1)[0] for i, t in enumerate(ids))
    assert out == "plain text"


def test_parse_tool_calls_hermes() -> None:
    content, calls = parse_tool_calls("Let me check. " + CALL)
    assert content == "Let me check. "
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    assert parse_tool_calls(CALL + CALL)[0] is None and len(parse_tool_calls(CALL + CALL)[1]) == 2
    assert parse_tool_calls("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert parse_tool_calls("no tools") == ("no tools", [])
    unclosed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')[1]
    assert unclosed[0]["function"] == {"name": "f", "arguments": "{}"}


def test_toolstream_never_leaks_the_call_into_content() -> None:
    ts = ToolStream()
    text = "Sure. " + CALL
    sent = "".join(ts.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, calls = ts.finish()
    assert sent + rest == "Sure. " and calls[0]["function"]["name"] == "get_weather"
    plain = ToolStream()
    assert plain.feed("a <tool") == "a " and plain.finish() == ("<tool", [])


def test_messages_for_template_parses_arguments_and_joins_parts() -> None:
    msgs = messages_for_template(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                ],
            },
        ]
    )
    assert msgs[0]["content"] == "ab" and msgs[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


def test_sampling_greedy_top_p_and_seeds() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample(logits, SamplingParams(temperature=0.0), make_generator(0, 0)) == 1
    assert all(sample(logits, SamplingParams(top_p=0.01), make_generator(s, 0)) == 1 for s in range(20))

    def draws(seed: int) -> list[int]:
        gen = make_generator(seed, 0)
        return [sample(logits, SamplingParams(), gen) for _ in range(20)]

    assert draws(5) == draws(5)
    lp = token_logprob(torch.log_softmax(logits, -1), 2, top=2)
    assert lp.top[0][0] == 1 and lp.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[2]))


class ScriptedEngine:
    """Enough of Engine for the HTTP app: every request "generates" the same scripted text."""

    def __init__(self, tokenizer: Any, script: str) -> None:
        from rlproxy.inference.adapters import AdapterSlots

        self.tokenizer, self.script = tokenizer, script
        self.served_name, self.model_path, self.max_model_len = "scripted", "/nowhere", 2048
        self.sampling_defaults: dict[str, float] = {}
        self.adapters = AdapterSlots(torch.nn.Linear(1, 1), "scripted")

    def submit(self, req: GenRequest) -> None:
        ids = self.tokenizer.encode(self.script) + [self.tokenizer.eos_token_id]
        for i in range(req.n):
            ts = TextStream(self.tokenizer, req.params.stop)
            for k, t in enumerate(ids):
                last = k == len(ids) - 1
                text, _ = ts.push(t, final=last)
                req.sink(RowDelta(i, [t], text, [], "stop" if last else None))

    def cancel(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True])
def test_app_turns_hermes_output_into_tool_calls(tiny_tokenizer: Any, stream: bool) -> None:
    app = create_engine_app(ScriptedEngine(tiny_tokenizer, "Checking. " + CALL))  # type: ignore[arg-type]
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        args: dict[str, Any] = {
            "model": "scripted",
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        }
        if not stream:
            c = client.chat.completions.create(**args).choices[0]
            calls, content, finish = c.message.tool_calls, c.message.content, c.finish_reason
        else:
            chunks = list(client.chat.completions.create(stream=True, **args))
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            calls = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        assert content == "Checking. " and finish == "tool_calls"
        assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {
            "city": "Paris"
        }
        plain = client.chat.completions.create(tool_choice="none", **args).choices[0]
        assert plain.message.tool_calls in (None, []) and "<tool_call>" in plain.message.content


def test_growing_cache_decodes_like_dynamic_cache_without_copying_per_token(tiny_model_dir: Any) -> None:
    """The engine's cache (kvbatch.GrowingLayer) gives the logits DynamicLayer gives, through a
    prefill, decode steps, changes of the batch (kvbatch.select: a middle row leaves, in the same
    buffer; kvbatch.splice: a longer row joins; the first row leaves) and more steps; between two
    changes every step writes into the same buffer. DynamicCache takes kvbatch's copying path."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from rlproxy.inference import kvbatch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 200, (3, 9), generator=g)
    joiner = torch.randint(10, 200, (1, 30), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # a left-padded row
    caches = {"dynamic": DynamicCache(), "growing": kvbatch.new_cache()}
    logits: dict[str, list[torch.Tensor]] = {k: [] for k in caches}
    buffers: list[int] = []
    with torch.inference_mode():
        for name, cache in caches.items():
            m = mask.clone()
            pos = (m.cumsum(-1) - 1).clamp(min=0)
            out = model(
                input_ids=ids, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True
            )
            logits[name].append(out.logits[:, -1])
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            for step in range(2 * kvbatch.HEADROOM + 5):  # past the first buffer's room
                if step == 7:
                    m = kvbatch.select(cache, m, [0, 2])
                    tok = tok[[0, 2]]
                    if name == "growing":  # the leaving row's place is taken in the same buffer
                        assert cache.layers[0].keys.untyped_storage().data_ptr() == buffers[-1]
                if step == 11:  # a longer row joins: both sides left-padded into one buffer
                    jm = torch.ones(1, 30, dtype=torch.long)
                    jcache = kvbatch.new_cache() if name == "growing" else DynamicCache()
                    jout = model(
                        input_ids=joiner,
                        attention_mask=jm,
                        position_ids=(jm.cumsum(-1) - 1),
                        past_key_values=jcache,
                        use_cache=True,
                    )
                    logits[name].append(jout.logits[:, -1])
                    m = kvbatch.splice(cache, m, jcache, jm)
                    tok = torch.cat([tok, jout.logits[:, -1].argmax(-1, keepdim=True)])
                if step == 40:  # the first row leaves: every later row moves up
                    m = kvbatch.select(cache, m, [1, 2])
                    tok = tok[[1, 2]]
                m = torch.cat([m, torch.ones(m.shape[0], 1, dtype=m.dtype)], dim=1)
                pos = m.sum(-1, keepdim=True) - 1
                out = model(
                    input_ids=tok, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True
                )
                logits[name].append(out.logits[:, -1])
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                if name == "growing":
                    buffers.append(cache.layers[0].keys.untyped_storage().data_ptr())
    assert all(isinstance(layer, kvbatch.GrowingLayer) for layer in caches["growing"].layers)
    for a, b in zip(logits["dynamic"], logits["growing"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the prefill's buffer, the splice's, then one more each time the room runs out
    assert 2 <= len(set(buffers)) <= 5, len(set(buffers))
