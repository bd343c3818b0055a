"""The Responses API (`POST /v1/responses`) over chat completions. Pure functions, no I/O.

rlproxy serves the Responses API itself: a Responses request becomes a chat-completions request,
which goes through the ordinary chat path (so exact token ids and sampling logprobs are captured on
every backend, tool calls included), and the chat answer becomes a Responses object, or a stream of
chat chunks becomes a stream of Responses events. The shapes follow OpenAI's API and vLLM 0.32's
server; everything emitted parses with the `openai` package's `Response` / `ResponseStreamEvent`.

    chat_request(body, history)          Responses body -> chat body  (ResponsesInputError: 400)
    response_object(body, chat, ...)     chat completion -> `response` object
    ResponseEvents(body, ...)            chat chunks -> Responses SSE events (start, feed, finish)
    conversation(chat_body, message)     the chat messages a `previous_response_id` continues from

A chain (`previous_response_id`) continues from the previous call's messages and answer; like vLLM,
the previous call's system messages (its `instructions`) are not carried over: the new request's
`instructions`, if any, lead the conversation. Reasoning items in `input` are dropped.
"""

from __future__ import annotations

import uuid
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


# ---------------------------------------------------------------------------------------------
# Response


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _want_logprobs(body: dict) -> bool:
    return LOGPROBS_INCLUDE in (body.get("include") or []) or bool(body.get("top_logprobs"))


def _logprob(entry: dict) -> dict:
    """A chat logprob entry -> a Responses output_text logprob."""
    return {
        "token": entry.get("token", ""),
        "logprob": entry.get("logprob"),
        "bytes": entry.get("bytes") or list(entry.get("token", "").encode()),
        "top_logprobs": [
            {"token": t.get("token", ""), "logprob": t.get("logprob"), "bytes": t.get("bytes") or []}
            for t in entry.get("top_logprobs") or ()
        ],
    }


def _message_item(item_id: str, text: str, logprobs: list, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def _reasoning_item(item_id: str, text: str, status: str | None) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(usage: dict | None) -> dict | None:
    if not usage:
        return None
    inp = usage.get("prompt_tokens") or 0
    out = usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens") or inp + out,
    }


def _shell(body: dict, *, response_id: str, created_at: int, model: str, status: str) -> dict:
    """The response object without output: the request's parameters echoed like OpenAI and vLLM."""
    tools = body.get("tools") or []
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto",
        "store": body.get("store", True) is not False,
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": tools,
        "top_logprobs": body.get("top_logprobs") or 0,
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "truncation": body.get("truncation") or "disabled",
        "usage": None,
        "user": body.get("user"),
    }


def _finish(response: dict, finish_reason: str | None) -> None:
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def response_object(body: dict, chat: dict, *, response_id: str, created_at: int) -> dict:
    """Non-streamed: a chat completion (dict) -> the Responses `response` object (see the module doc)."""
    response = _shell(
        body,
        response_id=response_id,
        created_at=created_at,
        model=chat.get("model") or body.get("model") or "",
        status="completed",
    )
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        response["output"].append(_reasoning_item(_new_id("rs"), reasoning, None))
    if message.get("content"):
        entries = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [_logprob(e) for e in entries] if _want_logprobs(body) else []
        response["output"].append(_message_item(_new_id("msg"), message["content"], logprobs, "completed"))
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        response["output"].append(
            _call_item(
                _new_id("fc"),
                call.get("id") or _new_id("call"),
                fn.get("name") or "",
                fn.get("arguments") or "",
                "completed",
            )
        )
    response["usage"] = _usage(chat.get("usage"))
    _finish(response, choice.get("finish_reason"))
    return response


class ResponseEvents:
    """Streamed: chat-completion chunk dicts in, Responses SSE event dicts out.

    `start()` gives response.created and response.in_progress; `feed(chunk)` the events a chunk
    makes (an output item is opened at its first delta and closed when another kind begins);
    `finish()` closes the open item and ends with response.completed, or response.incomplete when
    the model hit `max_output_tokens`; `fail(message)` ends a broken stream with response.failed.
    Only choice 0 is read (a Responses call has one answer)."""

    def __init__(self, body: dict, *, response_id: str, created_at: int, model: str) -> None:
        self.body = body
        self._response = _shell(
            body, response_id=response_id, created_at=created_at, model=model, status="in_progress"
        )
        self._seq = 0
        self._want_logprobs = _want_logprobs(body)
        self._open: dict | None = None  # the item being streamed (its final form is built on close)
        self._kind: str | None = None  # message | reasoning | function_call
        self._tool_index: int | None = None
        self._text: list[str] = []
        self._logprobs: list[dict] = []
        self._finish_reason: str | None = None
        self._usage: dict | None = None

    # -- events --------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict:
        return {**self._response, "output": list(self._response["output"])}

    @property
    def response(self) -> dict:
        """The response object as it stands (the final one once `finish` ran)."""
        return self._response

    def start(self) -> list[dict]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def _index(self) -> int:
        return len(self._response["output"])

    def _open_item(self, kind: str, item: dict) -> list[dict]:
        self._kind, self._open, self._text, self._logprobs = kind, item, [], []
        events = [self._event("response.output_item.added", output_index=self._index(), item=dict(item))]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._part_event("response.content_part.added", part))
        elif kind == "reasoning":
            events.append(
                self._part_event("response.content_part.added", {"type": "reasoning_text", "text": ""})
            )
        return events

    def _part_event(self, kind: str, part: dict) -> dict:
        return self._event(
            kind, item_id=self._open["id"], output_index=self._index(), content_index=0, part=part
        )

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        item, text, index = self._open, "".join(self._text), self._index()
        events: list[dict] = []
        if self._kind == "message":
            final = _message_item(item["id"], text, self._logprobs, "completed")
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=self._logprobs,
                )
            )
            events.append(self._part_event("response.content_part.done", final["content"][0]))
        elif self._kind == "reasoning":
            final = _reasoning_item(item["id"], text, "completed")
            events.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            )
            events.append(self._part_event("response.content_part.done", final["content"][0]))
        else:
            final = _call_item(item["id"], item["call_id"], item["name"], text, "completed")
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=final))
        self._response["output"].append(final)
        self._open = self._kind = self._tool_index = None
        return events

    # -- chunks --------------------------------------------------------------------------------
    def feed(self, chunk: dict) -> list[dict]:
        """The events one parsed chat chunk makes (none for a chunk without news)."""
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[dict] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                if self._kind != "reasoning":
                    events += self._close()
                    events += self._open_item("reasoning", _reasoning_item(_new_id("rs"), "", "in_progress"))
                self._text.append(reasoning)
                events.append(
                    self._event(
                        "response.reasoning_text.delta",
                        item_id=self._open["id"],
                        output_index=self._index(),
                        content_index=0,
                        delta=reasoning,
                    )
                )
            if delta.get("content"):
                if self._kind != "message":
                    events += self._close()
                    item = _message_item(_new_id("msg"), "", [], "in_progress")
                    item["content"] = []
                    events += self._open_item("message", item)
                entries = (choice.get("logprobs") or {}).get("content") or []
                logprobs = [_logprob(e) for e in entries] if self._want_logprobs else []
                self._logprobs.extend(logprobs)
                self._text.append(delta["content"])
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=self._open["id"],
                        output_index=self._index(),
                        content_index=0,
                        delta=delta["content"],
                        logprobs=logprobs,
                    )
                )
            for call in delta.get("tool_calls") or ():
                events += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def _tool_delta(self, call: dict) -> list[dict]:
        events: list[dict] = []
        fn = call.get("function") or {}
        index = call.get("index", 0)
        if self._kind != "function_call" or self._tool_index != index:
            events += self._close()
            item = _call_item(
                _new_id("fc"), call.get("id") or _new_id("call"), fn.get("name") or "", "", "in_progress"
            )
            events += self._open_item("function_call", item)
            self._tool_index = index
        elif fn.get("name"):  # a name in pieces (not sent by vLLM's parsers, but legal)
            self._open["name"] += fn["name"]
        if fn.get("arguments"):
            self._text.append(fn["arguments"])
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self._open["id"],
                    output_index=self._index(),
                    delta=fn["arguments"],
                )
            )
        return events

    def finish(self) -> list[dict]:
        """Close the open item; response.completed (or response.incomplete at the token limit)."""
        events = self._close()
        self._response["usage"] = _usage(self._usage)
        _finish(self._response, self._finish_reason)
        kind = "response.incomplete" if self._response["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=self._snapshot()))
        return events

    def fail(self, message: str) -> list[dict]:
        """End a stream the upstream broke: response.failed with the reason (no item is closed)."""
        self._response["status"] = "failed"
        self._response["error"] = {"code": "server_error", "message": message}
        self._response["usage"] = _usage(self._usage)
        return [self._event("response.failed", response=self._snapshot())]


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
