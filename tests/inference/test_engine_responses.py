"""The embedded engine's own parts of `POST /v1/responses`: its bounded store, and function calls
parsed from the model's hermes output, streamed and not (a scripted engine writes the call: what is
under test is the route, not the model). The shapes on both backends are in test_contract.py.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from test_engine_parts import CALL, ScriptedEngine

from rlproxy.inference.server import create_engine_app

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture
def client(tiny_tokenizer: Any) -> Any:
    engine = ScriptedEngine(tiny_tokenizer, "Checking. " + CALL)
    app = create_engine_app(engine, responses_kept=2)  # type: ignore[arg-type]
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


def test_function_call_streamed_and_not(client: openai.OpenAI) -> None:
    r = client.responses.create(model="scripted", input="weather?", tools=TOOLS)
    assert [o.type for o in r.output] == ["message", "function_call"] and r.status == "completed"
    assert r.output[0].content[0].text == "Checking. "
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    events = list(client.responses.create(model="scripted", input="weather?", tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ], kinds
    assert [o.type for o in events[-1].response.output] == ["message", "function_call"]
    # the call's output continues the chain: the stored conversation holds the call
    after = client.responses.create(
        model="scripted",
        previous_response_id=events[-1].response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=TOOLS,
    )
    assert after.previous_response_id == events[-1].response.id


def test_the_store_keeps_the_newest_responses_only(client: openai.OpenAI) -> None:
    ids = [client.responses.create(model="scripted", input=f"q{i}").id for i in range(3)]
    assert client.responses.retrieve(ids[2]).id == ids[2]
    with pytest.raises(openai.NotFoundError):  # evicted: the store holds 2
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="scripted", previous_response_id=ids[0], input="more")
    unstored = client.responses.create(model="scripted", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert client.responses.retrieve(ids[2]).id == ids[2]  # store=false evicted nothing
