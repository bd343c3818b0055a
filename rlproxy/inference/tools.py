"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the text.

The tools reach the model through its chat template; what it writes back is parsed here into
OpenAI `tool_calls` the way vLLM's `hermes` parser does (the text before the first `<tool_call>` is
the content; a block that is not valid JSON leaves the whole output as plain content). Streaming
holds back text from the first `<tool_call>` on and sends the parsed calls with the last chunk.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into (content or None, OpenAI tool_calls); no valid block = ([text], [])."""
    if TOOL_OPEN not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    for closed, unclosed in _BLOCK.findall(text):
        try:
            obj = json.loads((closed or unclosed).strip())
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    content = text[: text.find(TOOL_OPEN)]
    return (content or None), calls


class ToolStream:
    """Streams content up to a possible `<tool_call>` and keeps the rest for parsing at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        """Add a text delta; return the part that is certainly content."""
        self.text += delta
        at = self.text.find(TOOL_OPEN)
        if at != -1:
            limit = at
        else:
            limit = len(self.text)
            # hold back a tail that could still grow into "<tool_call>"
            for k in range(min(len(TOOL_OPEN) - 1, len(self.text)), 0, -1):
                if TOOL_OPEN.startswith(self.text[-k:]):
                    limit -= k
                    break
        limit = max(limit, self.sent)
        out = self.text[self.sent : limit]
        self.sent = limit
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: (content not yet sent, tool_calls); unparseable blocks come back as content."""
        _, calls = parse_tool_calls(self.text)
        if calls:
            return "", calls
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return rest, []


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages → what HF chat templates render: text parts joined, tool arguments as dicts."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                call["function"] = fn
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out
