"""The Responses API (`POST /v1/responses`) over chat completions: the request side. Pure, no I/O.

rlproxy serves the Responses API itself: a Responses request becomes a chat-completions request,
which goes through the ordinary chat path (so exact token ids and sampling logprobs are captured on
every backend, tool calls included), and the chat answer becomes a Responses object, or a stream of
chat chunks becomes a stream of Responses events. The shapes follow OpenAI's API and vLLM 0.32's
server; everything emitted parses with the `openai` package's `Response` / `ResponseStreamEvent`.

    chat_request(body, history)          Responses body -> chat body  (ResponsesInputError: 400)
    conversation(chat_body, message)     the chat messages a `previous_response_id` continues from

and the answer side in `wire/response_events.py` (as `messages.py` / `message_events.py`):

    response_object(body, chat, ...)     chat completion -> `response` object
    ResponseEvents(body, ...)            chat chunks -> Responses SSE events (start, feed, finish)

A chain (`previous_response_id`) continues from the previous call's messages and answer; like vLLM,
the previous call's system messages (its `instructions`) are not carried over: the new request's
`instructions`, if any, lead the conversation. Reasoning items in `input` are dropped.
"""

from __future__ import annotations

from typing import Any

# Passed on to the chat request unchanged (OpenAI's and vLLM's chat-compatible sampling fields).
_PASSED = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "user",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "chat_template_kwargs",
    "priority",
    "cache_salt",
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesInputError(ValueError):
    """A Responses request that cannot be served over chat completions (400 invalid_request_error).

    `param` names the offending field (`input[2].type`, `tools[0].type`, ...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------------------------------------
# Request


def _type_check(body: dict, field: str, types: tuple[type, ...], want: str) -> None:
    value = body.get(field)
    if value is None:
        return
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ResponsesInputError(f"Invalid type for '{field}': expected {want}.", field)


def _text_parts(content: Any, where: str) -> str:
    """A message's content (string or input_text/output_text/refusal parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesInputError(f"Invalid '{where}': expected a string or a list of parts.", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise ResponsesInputError(
                f"Unsupported content part type {kind!r} in '{where}[{j}]': only text parts are served.",
                f"{where}[{j}].type",
            )
    return "".join(texts)


def _input_messages(items: list) -> list[dict]:
    """Responses input items -> chat messages (a function_call joins the assistant message before it)."""
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ResponsesInputError(f"Invalid '{where}': expected an object.", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponsesInputError(
                    f"Invalid '{where}.role': expected one of user, assistant, system, developer.",
                    f"{where}.role",
                )
            text = _text_parts(item.get("content"), f"{where}.content")
            if role == "assistant":
                prev = out[-1] if out else None
                if prev and prev["role"] == "assistant" and prev.get("content") is None:
                    prev["content"] = text
                else:
                    out.append({"role": "assistant", "content": text})
            else:  # chat templates know `system`; `developer` is its Responses-era name
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise ResponsesInputError(f"Missing or invalid '{where}.{key}'.", f"{where}.{key}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            prev = out[-1] if out else None
            if prev and prev["role"] == "assistant":
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ResponsesInputError(f"Missing or invalid '{where}.call_id'.", f"{where}.call_id")
            output = _text_parts(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # the chat upstream is not given earlier reasoning (vLLM's chat path drops it too)
        else:
            raise ResponsesInputError(
                f"Unsupported input item type {kind!r} in '{where}': served are message, function_call, "
                "function_call_output and reasoning.",
                f"{where}.type",
            )
    return out


def _chat_tools(tools: list) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ResponsesInputError(
                f"Unsupported tool type {kind!r} in 'tools[{i}]': only function tools are served "
                "(built-in tools such as web_search, file_search or code_interpreter are not).",
                f"tools[{i}].type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ResponsesInputError(f"Missing required parameter: 'tools[{i}].name'.", f"tools[{i}].name")
        fn: dict[str, Any] = {"name": tool["name"]}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any, tools: list) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not any(t.get("name") == name for t in tools):
            raise ResponsesInputError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise ResponsesInputError(
        "Unsupported 'tool_choice': served are auto, none, required and {type: function, name}.",
        "tool_choice",
    )


def _response_format(text: Any) -> dict | None:
    if not isinstance(text, dict):
        raise ResponsesInputError("Invalid type for 'text': expected an object.", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ResponsesInputError(
                "Missing required parameter: 'text.format.schema'.", "text.format.schema"
            )
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        spec.setdefault("name", "response")
        return {"type": "json_schema", "json_schema": spec}
    raise ResponsesInputError(
        f"Unsupported 'text.format.type' {kind!r}: text, json_object or json_schema.", "text.format.type"
    )


def chat_request(body: dict, history: list[dict] | None = None) -> dict:
    """Responses request body -> chat-completions body (see the module doc); ResponsesInputError if
    the request uses what chat completions cannot serve. `history`: the chat messages of the
    `previous_response_id` chain, as `conversation` gave them."""
    if body.get("background"):
        raise ResponsesInputError("background responses are not supported.", "background")
    if body.get("prompt") is not None:
        raise ResponsesInputError("prompt templates are not supported.", "prompt")
    if body.get("conversation") is not None:
        raise ResponsesInputError(
            "conversations are not supported: chain calls with previous_response_id.", "conversation"
        )
    _type_check(body, "model", (str,), "a string")
    _type_check(body, "instructions", (str,), "a string")
    _type_check(body, "stream", (bool,), "a boolean")
    _type_check(body, "store", (bool,), "a boolean")
    _type_check(body, "max_output_tokens", (int,), "an integer")
    _type_check(body, "temperature", (int, float), "a number")
    _type_check(body, "top_p", (int, float), "a number")
    _type_check(body, "top_logprobs", (int,), "an integer")
    _type_check(body, "parallel_tool_calls", (bool,), "a boolean")
    _type_check(body, "tools", (list,), "an array")
    _type_check(body, "include", (list,), "an array")
    _type_check(body, "metadata", (dict,), "an object")
    _type_check(body, "previous_response_id", (str,), "a string")
    limit = body.get("max_output_tokens")
    if limit is not None and limit < 1:
        raise ResponsesInputError("'max_output_tokens' must be at least 1.", "max_output_tokens")

    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    if history:
        messages.extend(dict(m) for m in history if m.get("role") != "system")
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        messages.extend(_input_messages(inp))
    else:
        raise ResponsesInputError(
            "Missing required parameter: 'input' (a string or a list of items).", "input"
        )
    if not messages:
        raise ResponsesInputError("'input' holds no message to answer.", "input")

    chat: dict[str, Any] = {"messages": messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    tools = body.get("tools") or []
    if tools:
        chat["tools"] = _chat_tools(tools)
    if body.get("tool_choice") is not None:
        choice = _chat_tool_choice(body["tool_choice"], tools)
        if tools:
            chat["tool_choice"] = choice
        elif choice not in ("auto", "none"):
            raise ResponsesInputError("'tool_choice' needs 'tools'.", "tool_choice")
    if tools and body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if limit is not None:
        chat["max_tokens"] = limit
    if body.get("text") is not None:
        fmt = _response_format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    for key in _PASSED:
        if body.get(key) is not None:
            chat[key] = body[key]
    include = body.get("include") or []
    if LOGPROBS_INCLUDE in include or body.get("top_logprobs"):
        chat["logprobs"] = True
        if body.get("top_logprobs"):
            chat["top_logprobs"] = body["top_logprobs"]
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # response.completed carries usage
    return chat


def conversation(chat_body: dict, chat_message: dict) -> list[dict]:
    """The chat messages (the request's, then the assistant's answer with its tool calls) that a
    later request with `previous_response_id` continues from."""
    answer: dict[str, Any] = {"role": "assistant", "content": chat_message.get("content")}
    calls = [
        {
            "id": c.get("id"),
            "type": "function",
            "function": {
                "name": (c.get("function") or {}).get("name"),
                "arguments": (c.get("function") or {}).get("arguments"),
            },
        }
        for c in chat_message.get("tool_calls") or ()
    ]
    if calls:
        answer["tool_calls"] = calls
    return [*(dict(m) for m in chat_body.get("messages") or ()), answer]
