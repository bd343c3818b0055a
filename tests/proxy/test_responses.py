"""`POST /v1/responses` through the proxy: the real openai SDK, the embedded engine on the tiny model.

The proxy serves the Responses API over the upstream's chat completions: what is stored is the chat
form the model saw (token ids and logprobs exactly as the chat route stores them) plus what the client
sent and got. Tool-call *output* needs a model that calls tools, which the random tiny model does not:
those tests use a stub upstream that answers with vLLM-shaped tool calls (the test is about the proxy's
translation). The OpenAI Agents SDK tests live in tests/proxy/test_agents_sdk.py (another owner).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from fakes import BreakingStub, ToolStub
from proxy_helpers import completion_rows as _rows
from support import running

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _client(base: str, run_id: str | None = None, **kw: Any) -> openai.OpenAI:
    headers = {"X-Run-Id": run_id} if run_id else None
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", default_headers=headers, max_retries=0, **kw)


# ---------------------------------------------------------------------------------------------
# Captured like chat, on the real engine


def test_non_streamed_stores_tokens_like_the_chat_route(engine_proxy: Any) -> None:
    client = _client(engine_proxy.url, "resp-1")
    raw = client.responses.with_raw_response.create(
        model="tiny",
        instructions="You are terse.",
        input="Say hello.",
        max_output_tokens=8,
        temperature=1.0,
        extra_body={"seed": 7},
    )
    assert raw.headers["x-policy-step"] == "0"
    body = json.loads(raw.text)
    resp = raw.parse()
    assert (
        resp.id.startswith("resp_")
        and resp.object == "response"
        and resp.status in ("completed", "incomplete")
    )
    assert resp.instructions == "You are terse." and resp.max_output_tokens == 8
    # nothing of the capture reaches the client
    assert "token_ids" not in raw.text and "prompt_token_ids" not in raw.text
    assert all(p.get("logprobs") == [] for o in body["output"] for p in o.get("content") or [])
    assert resp.usage.output_tokens >= 1

    # the same call on the chat route, same seed: the same tokens, stored the same way
    chat = _client(engine_proxy.url, "chat-1").chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=1.0,
        seed=7,
    )
    r, c = _rows(engine_proxy, "run_id = 'resp-1'")[0], _rows(engine_proxy, "run_id = 'chat-1'")[0]
    assert (r["endpoint"], r["status"], r["status_code"], r["stream"]) == ("responses", "ok", 200, False)
    assert r["request"]["messages"] == c["request"]["messages"]
    assert r["prompt_token_ids"] == c["prompt_token_ids"] and r["prompt_token_ids"]
    assert r["token_ids"] == c["token_ids"] and len(r["token_ids"][0]) == resp.usage.output_tokens
    assert r["logprobs"][0] == pytest.approx(c["logprobs"][0], abs=1e-4)
    assert len(r["logprobs"][0]) == len(r["token_ids"][0])
    assert r["response"]["choices"][0]["logprobs"] is None  # stripped, as the chat route stores it
    assert r["response"]["choices"][0]["message"]["content"] == chat.choices[0].message.content
    assert resp.output_text == chat.choices[0].message.content
    assert r["response_id"] == resp.id and r["client_response"]["id"] == resp.id
    assert r["client_request"]["input"] == "Say hello."
    assert (r["prompt_tokens"], r["completion_tokens"]) == (resp.usage.input_tokens, resp.usage.output_tokens)


def test_streamed_is_relayed_as_events_and_stored(engine_proxy: Any) -> None:
    client = _client(engine_proxy.url, "resp-s")
    kinds = []
    with client.responses.stream(
        model="tiny", input="Count.", max_output_tokens=6, temperature=1.0, extra_body={"seed": 3}
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        # a cut at max_output_tokens ends with response.incomplete, as OpenAI's does (the SDK's
        # get_final_response() wants response.completed): the terminal event carries the response
        final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    text = final.output_text
    (row,) = _rows(engine_proxy, "run_id = 'resp-s'")
    assert (row["endpoint"], row["status"], row["stream"]) == ("responses", "ok", True)
    assert row["response"]["choices"][0]["message"]["content"] == text
    assert len(row["token_ids"][0]) == len(row["logprobs"][0]) == final.usage.output_tokens
    assert row["prompt_token_ids"] and all(isinstance(x, float) for x in row["logprobs"][0])
    assert row["client_response"]["id"] == final.id == row["response_id"]
    assert row["client_response"]["output"][0]["content"][0]["text"] == text
    assert row["finish_reason"] in ("stop", "length")

    # stream=True on create: the raw SSE names each event; the last one is terminal
    raw = httpx.post(
        f"{engine_proxy.url}/v1/responses",
        json={"model": "tiny", "input": "x", "stream": True, "max_output_tokens": 3},
        headers={"X-Run-Id": "resp-s2"},
        timeout=60,
    )
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "token_ids" not in raw.text


def test_function_call_output_turn_and_chain(engine_proxy: Any) -> None:
    """Turn 1 named a tool; turn 2 sends its function_call + function_call_output items with
    previous_response_id; turn 3 chains once more. One run, three rows, the views show it all."""
    client = _client(engine_proxy.url, "chain-1")
    first = client.responses.create(
        model="tiny",
        instructions="Use tools.",
        input="Weather in Oslo?",
        tools=[WEATHER],
        max_output_tokens=4,
    )
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        instructions="Use tools.",
        tools=[WEATHER],
        input=[
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        max_output_tokens=4,
    )
    # no run header: the chain continues in the run of the response it names
    third = _client(engine_proxy.url).responses.create(
        model="tiny", previous_response_id=second.id, input="Thanks!", max_output_tokens=3
    )
    assert third.previous_response_id == second.id
    rows = _rows(engine_proxy, "run_id = 'chain-1'")
    assert [r["seq"] for r in rows] == [0, 1, 2]
    msgs = rows[2]["request"]["messages"]
    roles = [m["role"] for m in msgs]
    # turn 3 has no instructions: the earlier system message is not carried over (like OpenAI, vLLM)
    assert roles == ["user", "assistant", "assistant", "tool", "assistant", "user"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert msgs[0]["content"] == "Weather in Oslo?" and msgs[-1]["content"] == "Thanks!"
    assert rows[1]["request"]["tools"][0]["function"]["name"] == "get_weather"

    view = engine_proxy.query(
        "SELECT role, content FROM messages WHERE run_id = 'chain-1' AND seq = 1 ORDER BY idx"
    )
    assert [r[0] for r in view] == ["system", "user", "assistant", "assistant", "tool", "assistant"]
    assert view[4][1] == "sunny"
    (traj,) = engine_proxy.query("SELECT messages, n_completions FROM trajectories WHERE run_id = 'chain-1'")
    traj_msgs = json.loads(traj[0])
    assert traj[1] == 3 and [m["role"] for m in traj_msgs] == [*roles, "assistant"]
    assert traj_msgs[-1]["content"] == third.output_text or (
        traj_msgs[-1]["content"] in ("", None) and not third.output_text
    )


def test_store_false_is_stored_but_not_continuable(engine_proxy: Any) -> None:
    client = _client(engine_proxy.url, "nostore")
    first = client.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    (row,) = _rows(engine_proxy, "run_id = 'nostore'")
    assert row["response_id"] is None and row["client_response"]["id"] == first.id and row["token_ids"]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(
            model="tiny", previous_response_id=first.id, input="again", max_output_tokens=2
        )
    assert info.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(first.id)
    assert info.value.body["code"] == "response_not_found"


def test_retrieve_gives_the_stored_object(engine_proxy: Any) -> None:
    client = _client(engine_proxy.url, "get-1")
    made = client.responses.create(model="tiny", input="hi", max_output_tokens=3, metadata={"k": "v"})
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    with client.responses.stream(model="tiny", input="hi", max_output_tokens=3) as stream:
        last = list(stream)[-1].response
    assert client.responses.retrieve(last.id).model_dump() == last.model_dump()
    prefixed = openai.OpenAI(base_url=f"{engine_proxy.url}/runs/get-1/v1", api_key="x", max_retries=0)
    assert prefixed.responses.retrieve(made.id).id == made.id


def test_chain_survives_a_restart(
    make_proxy: Any, engine_backend: Any, tiny_model_dir: Any, tmp_path: Any
) -> None:
    """previous_response_id is read from SQL: a new proxy on the same database continues the chain."""
    db = f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
    one = make_proxy(engine_backend.base_url, model=str(tiny_model_dir), db_url=db)
    first = _client(one.url, "restart").responses.create(model="tiny", input="hi", max_output_tokens=2)
    one.stop()
    two = make_proxy(engine_backend.base_url, model=str(tiny_model_dir), db_url=db)
    two.db_path = tmp_path / "shared.db"
    second = _client(two.url).responses.create(
        model="tiny", previous_response_id=first.id, input="more", max_output_tokens=2
    )
    rows = _rows(two, "run_id = 'restart'")
    assert [r["response_id"] for r in rows] == [first.id, second.id]
    assert [m["content"] for m in rows[1]["request"]["messages"]][::2] == ["hi", "more"]


# ---------------------------------------------------------------------------------------------
# Bad input: OpenAI's error shape, nothing stored wrongly


BAD = [
    ({"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", None),
    ({"model": "tiny", "input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type", None),
    (
        {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        400,
        "input[0].content[0].type",
        None,
    ),
    ({"model": "tiny"}, 400, "input", None),
    ({"model": "tiny", "input": "x", "background": True}, 400, "background", None),
    ({"model": "tiny", "input": "x", "max_output_tokens": "many"}, 400, "max_output_tokens", None),
    (
        {"model": "tiny", "input": "x", "previous_response_id": "resp_nope"},
        404,
        "previous_response_id",
        "previous_response_not_found",
    ),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD, ids=[b[2] for b in BAD])
def test_bad_input(engine_proxy: Any, body: dict, status: int, param: str, code: str | None) -> None:
    resp = httpx.post(f"{engine_proxy.url}/v1/responses", json=body, headers={"X-Run-Id": "bad"}, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code
    assert err["type"] == ("invalid_request_error")
    assert engine_proxy.query("SELECT count(*) FROM completions") == [(0,)]
    assert engine_proxy.query("SELECT count(*) FROM runs") == [(0,)]


def test_bad_json_and_sdk_errors(engine_proxy: Any) -> None:
    resp = httpx.post(
        f"{engine_proxy.url}/runs/r1/v1/responses",
        content=b'{"input": ',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as info:
        _client(engine_proxy.url, "bad2").responses.create(
            model="tiny", input="x", tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}]
        )
    assert info.value.body["param"] == "tools[0].type"
    assert engine_proxy.query("SELECT count(*) FROM completions") == [(0,)]


def test_run_path_prefix_and_policy_pin(engine_proxy: Any) -> None:
    client = openai.OpenAI(base_url=f"{engine_proxy.url}/runs/pfx-1/v1", api_key="x", max_retries=0)
    raw = client.responses.with_raw_response.create(model="tiny", input="hi", max_output_tokens=2)
    assert raw.headers["x-policy-step"] == "0"
    (row,) = _rows(engine_proxy, "run_id = 'pfx-1'")
    assert row["endpoint"] == "responses"
    group = engine_proxy.query("SELECT group_id FROM runs WHERE id = 'pfx-1'")[0][0]
    assert group.startswith("g-")  # the default group: a hash of the chat form's head


# ---------------------------------------------------------------------------------------------
# Tool calls out of the model: a stub upstream that answers with vLLM-shaped tool calls


@pytest.fixture
def tool_stub(loop_thread: Any) -> Any:
    with running(loop_thread, ToolStub(usage=False)) as stub:
        yield stub


def test_tool_call_answer_non_streamed_and_streamed(make_proxy: Any, tool_stub: ToolStub) -> None:
    proxy = make_proxy(tool_stub.url)
    client = _client(proxy.url, "tools-1")
    resp = client.responses.create(model="stub-model", input="Weather?", tools=[WEATHER])
    assert [o.type for o in resp.output] == ["message", "function_call"]
    call = resp.output[1]
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "chatcmpl-tool-abc",
        "get_weather",
        {"city": "Oslo"},
    )

    with client.responses.stream(model="stub-model", input="Weather?", tools=[WEATHER]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == '{"city": "Oslo"}' and final.output[1].call_id == "chatcmpl-tool-abc"

    rows = _rows(proxy, "run_id = 'tools-1'")
    assert [r["stream"] for r in rows] == [False, True]
    for r in rows:
        assert r["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert r["token_ids"][0] and len(r["logprobs"][0]) == len(r["token_ids"][0])
    assert rows[1]["token_ids"] == [[10, 11, 12, 13, 14]] and rows[1]["prompt_token_ids"] == [1, 2, 3]
    view = proxy.query(
        "SELECT role, tool_calls FROM messages WHERE run_id = 'tools-1' AND seq = 1 ORDER BY idx"
    )
    assert view[-1][0] == "assistant" and json.loads(view[-1][1])[0]["id"] == "chatcmpl-tool-abc"

    # the next turn answers the call by previous_response_id: the stored tool call leads into it
    client.responses.create(
        model="stub-model",
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": final.output[1].call_id, "output": "sunny"}],
    )
    msgs = _rows(proxy, "run_id = 'tools-1'")[2]["request"]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["tool_calls"][0]["id"] == msgs[2]["tool_call_id"] == "chatcmpl-tool-abc"


# ---------------------------------------------------------------------------------------------
# Rewarded and trained like any run


def test_rewarded_responses_runs_train_on_sampled_tokens_only(
    engine_proxy: Any, tiny_model_dir: Any, tmp_path: Any
) -> None:
    """Two 2-turn Responses runs (the second turn chained, with a function_call_output) of one group,
    rewarded 1 and 0: the group is ready, every sample is the stored prompt + the sampled tokens (loss
    only on what the model sampled, never on the prompt, the tool output or earlier turns), and a
    GRPO step trains on exactly those tokens."""
    import torch
    from oracle import build_samples, collate

    from rlproxy.storage.training import load_runs, ready_groups
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy
    from rlproxy.trainer.step import make_optimizer, train_step

    for i, reward in enumerate((1.0, 0.0)):
        client = _client(engine_proxy.url, f"train-{i}")
        first = client.responses.create(
            model="tiny",
            input="Weather in Oslo?",
            tools=[WEATHER],
            max_output_tokens=4,
            extra_body={"seed": i},
        )
        client.responses.create(
            model="tiny",
            previous_response_id=first.id,
            input=[
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            max_output_tokens=4,
            extra_body={"seed": 10 + i},
        )
        r = httpx.post(f"{engine_proxy.url}/v1/runs/train-{i}/reward", json={"reward": reward}, timeout=30)
        assert r.status_code == 200, r.text
    engine_proxy.flush()
    engine = engine_proxy.state.engine
    # no X-Group-Id: the default group (hash of the chat form's head) puts both runs together
    groups = engine_proxy.lt.run(ready_groups(engine, group_size=2, group_timeout=3600))
    assert [sorted(g.run_ids) for g in groups] == [["train-0", "train-1"]]
    runs = engine_proxy.lt.run(load_runs(engine, ["train-0", "train-1"]))
    assert [[c.endpoint for c in r.completions] for r in runs] == [["responses", "responses"]] * 2

    config = TrainerConfig(
        learning_rate=5e-3, micro_batch_size=4, checkpoint_dir=str(tmp_path / "ck"), seed=0
    )
    model, tok = load_policy(str(tiny_model_dir), config)
    samples, counts = build_samples(runs, {"train-0": 1.0, "train-1": -1.0}, tok, 4096)
    stored = [(c.prompt_token_ids, c.token_ids[0], c.logprobs[0]) for r in runs for c in r.completions]
    assert counts.rebuilt == 0 and len(samples) == 4
    assert [(s.prompt_ids, s.completion_ids) for s in samples] == [(p, t) for p, t, _ in stored]
    for s, (*_, lp) in zip(samples, stored, strict=True):
        assert s.old_logprobs == pytest.approx(lp, abs=1e-6)
    batch = collate(samples, tok.pad_token_id)
    assert batch.num_tokens == sum(len(t) for _, t, _ in stored)  # the mask covers the sampled tokens only
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    result = train_step(model, tok, make_optimizer(model, config), runs, config)
    assert not result.skipped and result.num_runs == 2 and result.num_tokens == batch.num_tokens
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


# ---------------------------------------------------------------------------------------------
# Streams that end early


def test_upstream_breaking_mid_stream_ends_with_response_failed(make_proxy: Any, loop_thread: Any) -> None:
    with running(loop_thread, BreakingStub()) as stub:
        proxy = make_proxy(stub.url)
        with _client(proxy.url, "broken").responses.create(
            model="stub-model", input="x", stream=True
        ) as stream:
            events = list(stream)
        assert events[-1].type == "response.failed"
        message = events[-1].response.error.message
        assert events[-1].response.status == "failed" and "model server" in message
        assert "127.0.0.1" not in message and "http" not in message  # issue 22 case 10: never the address
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
        (row,) = _rows(proxy, "run_id = 'broken'")
        assert (row["status"], row["status_code"], row["response_id"]) == ("error", 502, None)
        assert row["token_ids"] == [[7, 7]] and row["client_response"]["status"] == "failed"
        assert "upstream stream broke" in row["error"]


def test_client_disconnect_cancels_and_stores_the_partial(make_proxy: Any, stub: Any) -> None:
    stub.delay, stub.tokens = 3.0, 30  # 0.1 s per token: the client leaves long before the end
    proxy = make_proxy(stub.url)
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/responses",
        json={"model": "stub-model", "input": "x", "stream": True},
        headers={"X-Run-Id": "gone"},
        timeout=30,
    ) as resp:
        for line in resp.iter_lines():
            if "response.output_text.delta" in line:
                break
    for _ in range(100):
        rows = _rows(proxy, "run_id = 'gone'")
        if rows:
            break
        time.sleep(0.05)
    (row,) = rows
    assert (row["status"], row["status_code"], row["response_id"]) == ("cancelled", 499, None)
    assert 1 <= len(row["token_ids"][0]) < 30
    for _ in range(100):
        if stub.disconnects:
            break
        time.sleep(0.05)
    assert stub.disconnects == 1  # the upstream generation was cancelled too
