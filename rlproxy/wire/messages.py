"""Anthropic's Messages API (`POST /v1/messages`) over chat completions. Pure functions, no I/O.

Like the Responses API (`wire/responses.py`): a Messages request becomes a chat-completions request,
which takes the ordinary chat path (so exact token ids and sampling logprobs are captured on every
backend), and the chat answer becomes a `message` object, or a stream of chat chunks becomes a
stream of Messages events. What is emitted parses with the `anthropic` package's `Message` /
`RawMessageStreamEvent`; the conversion follows vLLM 0.32's own Anthropic server where it has one.

    chat_request(body)                   Messages body -> chat body  (MessagesInputError: 400)
    count_request(body)                  count_tokens body -> the chat body whose prompt is counted
    error_body(status, message)          Anthropic's error shape, its `type` from the status

The answer side (`message` objects and stream events) is `wire/message_events.py`.

The mapping, request side: `system` (a string, or text blocks joined by "\\n"; Claude Code's
per-request `x-anthropic-billing-header` block is dropped, as vLLM does, since it would defeat
prefix caching and default grouping) leads as a system message; each message's text blocks are
joined by "\\n"; `tool_use` blocks become the assistant's `tool_calls` (arguments = the JSON of
`input`), `tool_result` blocks become `tool` messages (before the user's text of the same turn);
earlier `thinking`/`redacted_thinking` blocks are dropped (the chat upstream is not given earlier
reasoning). `tools` become function tools, `tool_choice` auto/any/tool/none -> auto/required/named/
none (`disable_parallel_tool_use` -> `parallel_tool_calls: false`), `stop_sequences` -> `stop`,
`temperature`/`top_p`/`top_k` and `max_tokens` as they are (and vLLM's chat extras sent as extra
fields: `seed`, `min_p`, penalties, ...), `output_config.format` (a JSON schema)
-> `response_format`. Accepted and changing nothing the model sees (recorded with the client's
request): `cache_control` anywhere, `metadata` (`user_id`), `thinking` (any type: the answer simply
has no thinking block), `context_management`, `output_config.effort`, `service_tier`, citations
settings, unknown top-level fields. Refused with a 400 naming the field, since a text-only chat
model cannot serve them faithfully: image, document, search_result and container blocks,
server tools (`web_search_*`, `bash_*`, `text_editor_*`, `computer_*`, ... any tool `type` but
`custom`), server-tool blocks, `mcp_servers`, `container`.
"""

from __future__ import annotations

import json
from typing import Any

BILLING_HEADER = "x-anthropic-billing-header"
_TEXT_ONLY = "the model behind this proxy reads text only"
_CLIENT_TOOLS = (None, "custom")
# Passed on to the chat request unchanged: Anthropic's sampling fields, and the chat-compatible ones
# vLLM adds that a client may send as extra fields (`seed` makes a call reproducible).
_PASSED = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "chat_template_kwargs",
    "priority",
    "cache_salt",
)


class MessagesInputError(ValueError):
    """A Messages request that cannot be served over chat completions (400 invalid_request_error).

    `param` names the offending field (`messages[1].content[0].type`, `tools[0].type`, ...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------------------------------------
# Errors

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_status(status: int) -> int:
    """The status Anthropic answers where rlproxy's OpenAI routes use another (422 is 400 there)."""
    return 400 if status == 422 else status


def error_body(status: int, message: str) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`, the type from the status."""
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---------------------------------------------------------------------------------------------
# Request


def _need(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise MessagesInputError(message, param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _refuse_block(kind: Any, where: str) -> MessagesInputError:
    if kind in ("image", "document", "search_result", "container_upload"):
        why = f"{kind} blocks are not served: {_TEXT_ONLY}"
    elif isinstance(kind, str) and (kind.startswith(("server_tool", "mcp_")) or kind.endswith("_result")):
        why = f"{kind} blocks are not served: server tools run at Anthropic, not behind this proxy"
    else:
        why = f"unsupported content block type {kind!r}"
    return MessagesInputError(f"{where}.type: {why}.", f"{where}.type")


def _text(block: dict, where: str) -> str:
    _need(isinstance(block.get("text"), str), f"{where}.text: Field required (a string).", f"{where}.text")
    return block["text"]


def _texts(blocks: Any, where: str, what: str) -> list[str]:
    """The texts of a list of text blocks (400 naming the first that is not one)."""
    _need(isinstance(blocks, list), f"{where}: Input should be a string or a list of {what}.", where)
    texts = []
    for k, block in enumerate(blocks):
        inner = f"{where}[{k}]"
        _need(isinstance(block, dict), f"{inner}: Input should be an object.", inner)
        if block.get("type") != "text":
            raise _refuse_block(block.get("type"), inner)
        texts.append(_text(block, inner))
    return texts


def _system(system: Any) -> str | None:
    if isinstance(system, str):
        return system or None
    texts = _texts(system, "system", "text blocks")
    return "\n".join(t for t in texts if not t.startswith(BILLING_HEADER)) or None


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(_texts(content, where, "blocks"))


def _message(msg: Any, i: int, out: list[dict]) -> None:
    """One Messages message -> chat messages appended to `out` (a user turn's tool results first)."""
    where = f"messages[{i}]"
    _need(isinstance(msg, dict), f"{where}: Input should be an object.", where)
    role = msg.get("role")
    _need(
        role in ("user", "assistant"),
        f"{where}.role: Input should be 'user' or 'assistant'.",
        f"{where}.role",
    )
    content = msg.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    _need(
        isinstance(content, list),
        f"{where}.content: Input should be a string or a list of blocks.",
        f"{where}.content",
    )
    texts: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        _need(isinstance(block, dict), f"{at}: Input should be an object.", at)
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not given to the chat upstream (see the module doc)
        elif kind == "tool_use" and role == "assistant":
            for key in ("id", "name"):
                _need(
                    isinstance(block.get(key), str), f"{at}.{key}: Field required (a string).", f"{at}.{key}"
                )
            args = block.get("input", {})
            _need(isinstance(args, dict), f"{at}.input: Input should be an object.", f"{at}.input")
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        elif kind == "tool_result" and role == "user":
            _need(
                isinstance(block.get("tool_use_id"), str),
                f"{at}.tool_use_id: Field required (a string).",
                f"{at}.tool_use_id",
            )
            text = _tool_result_text(block.get("content"), f"{at}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise _refuse_block(kind, at)
    out.extend(results)
    if role == "assistant":
        if texts or calls:
            answer: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if calls:
                answer["tool_calls"] = calls
            out.append(answer)
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})


def _tools(tools: Any) -> list[dict]:
    _need(isinstance(tools, list), "tools: Input should be a list.", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        _need(isinstance(tool, dict), f"{where}: Input should be an object.", where)
        if tool.get("type") not in _CLIENT_TOOLS:
            raise MessagesInputError(
                f"{where}.type: server tool {tool.get('type')!r} is not served: only client tools "
                "(name, description, input_schema) run behind this proxy.",
                f"{where}.type",
            )
        _need(
            isinstance(tool.get("name"), str) and tool["name"],
            f"{where}.name: Field required.",
            f"{where}.name",
        )
        schema = tool.get("input_schema")
        _need(
            isinstance(schema, dict),
            f"{where}.input_schema: Field required (an object).",
            f"{where}.input_schema",
        )
        fn: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, tools: list) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls or None)."""
    _need(isinstance(choice, dict), "tool_choice: Input should be an object.", "tool_choice")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "none":
        return "none", None
    _need(bool(tools), f"tool_choice.type: {kind!r} needs 'tools'.", "tool_choice")
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        _need(
            isinstance(name, str) and any(t.get("name") == name for t in tools),
            f"tool_choice.name: tool {name!r} is not in 'tools'.",
            "tool_choice.name",
        )
        return {"type": "function", "function": {"name": name}}, parallel
    raise MessagesInputError(
        "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'.", "tool_choice.type"
    )


def _messages(body: dict) -> list[dict]:
    for key in ("mcp_servers", "container"):
        if body.get(key):
            raise MessagesInputError(f"{key}: not served: this proxy runs no server-side tools.", key)
    messages: list[dict] = []
    if body.get("system") is not None:
        system = _system(body["system"])
        if system is not None:
            messages.append({"role": "system", "content": system})
    conv = body.get("messages")
    _need(isinstance(conv, list) and bool(conv), "messages: Field required (a non-empty list).", "messages")
    for i, msg in enumerate(conv):
        _message(msg, i, messages)
    return messages


def count_request(body: dict) -> dict:
    """`POST /v1/messages/count_tokens` body -> the chat body (messages, tools) whose prompt is counted."""
    _need(isinstance(body.get("model"), str), "model: Field required.", "model")
    chat: dict[str, Any] = {"model": body["model"], "messages": _messages(body)}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    return chat


def chat_request(body: dict) -> dict:
    """Messages request body -> chat-completions body (see the module doc); MessagesInputError if the
    request uses what chat completions cannot serve, or lacks what the Messages API requires."""
    _need(isinstance(body.get("model"), str), "model: Field required.", "model")
    limit = body.get("max_tokens")
    _need(limit is not None, "max_tokens: Field required.", "max_tokens")
    _need(
        _is_int(limit) and limit >= 1, "max_tokens: Input should be an integer of at least 1.", "max_tokens"
    )
    for key in ("temperature", "top_p"):
        _need(body.get(key) is None or _is_num(body[key]), f"{key}: Input should be a number.", key)
    _need(body.get("top_k") is None or _is_int(body["top_k"]), "top_k: Input should be an integer.", "top_k")
    _need(
        body.get("stream") is None or isinstance(body["stream"], bool),
        "stream: Input should be a boolean.",
        "stream",
    )
    _need(
        body.get("metadata") is None or isinstance(body["metadata"], dict),
        "metadata: Input should be an object.",
        "metadata",
    )
    stops = body.get("stop_sequences")
    _need(
        stops is None or (isinstance(stops, list) and all(isinstance(s, str) for s in stops)),
        "stop_sequences: Input should be a list of strings.",
        "stop_sequences",
    )

    chat: dict[str, Any] = {"model": body["model"], "messages": _messages(body), "max_tokens": limit}
    tools = body.get("tools") or []
    if tools:
        chat["tools"] = _tools(tools)
    if body.get("tool_choice") is not None:
        choice, parallel = _tool_choice(body["tool_choice"], tools)
        if tools:
            chat["tool_choice"] = choice
            if parallel is not None:
                chat["parallel_tool_calls"] = parallel
    if stops:
        chat["stop"] = stops
    for key in _PASSED:
        if body.get(key) is not None:
            chat[key] = body[key]
    fmt = (
        (body.get("output_config") or {}).get("format")
        if isinstance(body.get("output_config"), dict)
        else None
    )
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt["schema"]},
        }
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # message_delta carries usage
    return chat
