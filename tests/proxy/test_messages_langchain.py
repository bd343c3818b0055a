"""LangChain's `ChatAnthropic` pointed at the proxy: invoke and stream on the embedded engine (real
tokens captured under the run), `bind_tools` on the scripted tool-calling upstream (the tiny model
never calls tools), a tool round trip through LangChain's own message types."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import ToolStub
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from proxy_helpers import completion_rows as rows
from support import running


@tool
def get_weather(city: str) -> str:
    """Weather of a city."""
    return f"sunny in {city}"


def _model(base: str, run_id: str, model: str, **kw: Any) -> ChatAnthropic:
    return ChatAnthropic(
        model=model,
        base_url=base,
        api_key="x",
        default_headers={"X-Run-Id": run_id},
        max_retries=0,
        max_tokens=kw.pop("max_tokens", 6),
        **kw,
    )


def test_invoke_and_stream_on_the_engine(engine_proxy: Any) -> None:
    llm = _model(engine_proxy.url, "lc-1", "tiny")
    answer = llm.invoke([HumanMessage("Say hello.")])
    assert isinstance(answer.content, str) and answer.usage_metadata["output_tokens"] >= 1
    assert answer.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    chunks = list(llm.stream("Count to three."))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    streamed = sum(chunks[1:], chunks[0])
    stored = rows(engine_proxy, "run_id = 'lc-1'")
    assert [(r["endpoint"], r["stream"], r["status"]) for r in stored] == [
        ("messages", False, "ok"),
        ("messages", True, "ok"),
    ]
    assert stored[0]["response"]["choices"][0]["message"]["content"] == answer.content
    assert stored[1]["response"]["choices"][0]["message"]["content"] == streamed.text
    assert all(r["token_ids"][0] and len(r["logprobs"][0]) == len(r["token_ids"][0]) for r in stored)


@pytest.fixture
def tool_stub(loop_thread: Any) -> Any:
    s = ToolStub()
    s.CALL = {**s.CALL, "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    with running(loop_thread, s):
        yield s


def test_bind_tools_round_trip(make_proxy: Any, tool_stub: ToolStub) -> None:
    proxy = make_proxy(tool_stub.url)
    llm = _model(proxy.url, "lc-tools", "stub-model", max_tokens=50).bind_tools([get_weather])
    ask = HumanMessage("Weather in Oslo?")
    first = llm.invoke([ask])
    assert first.tool_calls == [
        {"name": "get_weather", "args": {"city": "Oslo"}, "id": "chatcmpl-tool-abc", "type": "tool_call"}
    ]
    streamed = None
    for c in llm.stream([ask]):
        streamed = c if streamed is None else streamed + c
    assert (
        streamed.tool_calls[0]["args"] == {"city": "Oslo"} and streamed.tool_calls[0]["name"] == "get_weather"
    )
    result = get_weather.invoke(first.tool_calls[0])
    assert isinstance(result, ToolMessage)
    llm.invoke([ask, first, result])
    sent = tool_stub.bodies[-1]["messages"]
    assert sent[-2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert sent[-1] == {"role": "tool", "tool_call_id": "chatcmpl-tool-abc", "content": "sunny in Oslo"}
    assert tool_stub.bodies[-1]["tools"][0]["function"]["name"] == "get_weather"
    assert [r["stream"] for r in rows(proxy, "run_id = 'lc-tools'")] == [False, True, False]
