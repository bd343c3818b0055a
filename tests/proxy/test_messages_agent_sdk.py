"""A Claude Agent SDK agent (the `claude-agent-sdk` wheel, which bundles the Claude Code CLI) pointed at
the proxy with `ANTHROPIC_BASE_URL`, its run key from `ANTHROPIC_CUSTOM_HEADERS`, and one custom tool
(an in-process MCP server). The upstream is scripted (the tiny model never calls tools): it calls the
custom tool until it sees the tool's result, then answers. Every call the CLI makes is captured under
the one run, in Claude Code's own request shape (system blocks, `?beta=true`, 32000 max_tokens...)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
from fakes import write_sse
from proxy_helpers import completion_rows as rows
from stub_upstream import StubUpstream

agent_sdk = pytest.importorskip("claude_agent_sdk")
TOOL = "mcp__wx__get_weather"


class AgentStub(StubUpstream):
    """Calls the custom tool, or (once a tool result is in the conversation) answers in text."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict] = []

    def _answer(self, req: dict) -> tuple[str, list[dict]]:
        self.bodies.append(req)
        if any(m.get("role") == "tool" for m in req.get("messages") or ()):
            return "It is sunny in Oslo.", []
        offered = [t["function"]["name"] for t in req.get("tools") or ()]
        if TOOL not in offered:
            return "Weather check.", []  # a side call (a title, a summary): no tool
        call = {"id": f"toolu_{len(self.bodies)}", "type": "function"}
        return "", [{**call, "function": {"name": TOOL, "arguments": '{"city": "Oslo"}'}}]

    def _full(self, req: dict, chat: bool) -> dict:
        out = super()._full(req, chat)
        text, calls = self._answer(req)
        out["choices"][0]["message"] = {"role": "assistant", "content": text or None, "tool_calls": calls}
        out["choices"][0]["finish_reason"] = "tool_calls" if calls else "stop"
        return out

    async def _stream(self, req: dict, chat: bool, delay: float, w: asyncio.StreamWriter) -> None:
        text, calls = self._answer(req)
        head = {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req["model"],
        }
        ids = bool(req.get("return_token_ids"))

        def chunk(delta: dict, tok: int, finish: str | None = None) -> dict:
            c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            c["token_ids"] = [tok] if ids else None
            return {**head, "choices": [c]}

        first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        first["prompt_token_ids"] = [1, 2, 3] if ids else None
        events = [first]
        if text:
            events.append(chunk({"content": text}, 10))
        for i, call in enumerate(calls):
            events.append(chunk({"tool_calls": [{"index": i, **call}]}, 11))
        events.append(chunk({}, 12, "tool_calls" if calls else "stop"))
        events.append(
            {**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
        )
        write_sse(w, events)


def test_claude_agent_sdk_agent_with_a_custom_tool(make_proxy: Any, loop_thread: Any, tmp_path: Any) -> None:
    from claude_agent_sdk import AssistantMessage, ClaudeAgentOptions, ResultMessage, TextBlock, ToolUseBlock

    stub = AgentStub()
    loop_thread.run(stub.start())
    calls: list[dict] = []

    @agent_sdk.tool("get_weather", "Weather of a city", {"city": str})
    async def get_weather(args: dict) -> dict:
        calls.append(args)
        return {"content": [{"type": "text", "text": f"sunny in {args['city']}"}]}

    try:
        proxy = make_proxy(stub.url)
        options = ClaudeAgentOptions(
            model="stub-model",
            tools=[],  # no built-in tools (Bash, Read, ...): only the custom one
            mcp_servers={"wx": agent_sdk.create_sdk_mcp_server("wx", "1.0.0", [get_weather])},
            allowed_tools=[TOOL],
            max_turns=4,
            cwd=str(tmp_path),
            setting_sources=[],
            env={
                "ANTHROPIC_BASE_URL": proxy.url,
                "ANTHROPIC_API_KEY": "x",
                "ANTHROPIC_CUSTOM_HEADERS": "X-Run-Id: agent-1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "DISABLE_AUTOUPDATER": "1",
                "HOME": str(tmp_path),
                "PATH": os.environ.get("PATH", ""),
            },
        )

        async def go() -> list[Any]:
            return [m async for m in agent_sdk.query(prompt="What is the weather in Oslo?", options=options)]

        messages = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        loop_thread.run(stub.stop())
    used = [
        b
        for m in messages
        if isinstance(m, AssistantMessage)
        for b in m.content
        if isinstance(b, ToolUseBlock)
    ]
    texts = [
        b.text
        for m in messages
        if isinstance(m, AssistantMessage)
        for b in m.content
        if isinstance(b, TextBlock)
    ]
    assert calls == [{"city": "Oslo"}] and [u.name for u in used] == [TOOL]
    assert "It is sunny in Oslo." in texts
    result = [m for m in messages if isinstance(m, ResultMessage)]
    assert result and not result[-1].is_error

    stored = rows(proxy, "run_id = 'agent-1'")
    assert len(stored) >= 2 and all(r["endpoint"] == "messages" and r["status"] == "ok" for r in stored)
    assert proxy.query("SELECT count(*) FROM completions WHERE run_id IS NULL OR run_id != 'agent-1'") == [
        (0,)
    ]
    turns = [r for r in stored if TOOL in [t["function"]["name"] for t in r["request"].get("tools") or ()]]
    assert turns[-1]["request"]["messages"][-1]["role"] == "tool"
    assert turns[-1]["request"]["messages"][-1]["content"] == "sunny in Oslo"
    # Claude Code's own request shape, accepted and recorded; the billing header never reaches the model
    for r in stored:
        cr = r["client_request"]
        assert cr["max_tokens"] == 32000 and cr["thinking"]["type"] == "adaptive"
        assert "session_id" in cr["metadata"]["user_id"] and "context_management" in cr
        assert cr["system"][0]["text"].startswith("x-anthropic-billing-header")
        assert "billing" not in r["request"]["messages"][0]["content"]
