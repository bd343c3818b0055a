"""Transparent capture: ask the upstream for exact tokens, keep them, hand the client what it asked for.

To train on the tokens the model really sampled, the proxy needs vLLM's `return_token_ids` (top-level
`prompt_token_ids` — per choice on /v1/completions — and per-choice `token_ids`) and the sampling
`logprobs` (chat: `choice.logprobs.content[i].logprob`; completions: `choice.logprobs.token_logprobs`).
When the client did not ask for them they are injected upstream and stripped from what it receives:
a stripped field is set back to `null`, which is exactly what vLLM sends when it was not asked (it
serializes unrequested fields as explicit nulls, in streams too). Only those fields are touched.
The stored `prompt_token_ids` is one list, or one list per choice when a batched /v1/completions
gave its choices different prompts (`choice_prompts`).

An upstream's answer is shape-checked before it is captured (`shape_problem`): a 200 that is not a
JSON object, or whose choices, messages, tool calls, token ids or logprobs are not what the OpenAI
shape says, is refused by the route (502, stored as an error); token counts are coerced to
integers or dropped (`records.as_count`). The stream assembler skips what it cannot read.

Streams are assembled chunk by chunk into the non-streaming shape for the store (text, tool-call
deltas, token ids, logprobs, finish reason, usage), while the chunks themselves go on to the client.
(Over 400 lines: the shape check, the strip and the stream fold read one shape, so they stay together.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlproxy.storage.records import CompletionRecord, Endpoint, as_count

CHAT = Endpoint.CHAT  # a module global: compared on every stream chunk


@dataclass(slots=True)
class Injected:
    """Which capture fields the proxy added to the upstream request (and so must strip)."""

    token_ids: bool = False
    logprobs: bool = False

    @property
    def any(self) -> bool:
        return self.token_ids or self.logprobs


def inject(body: dict, endpoint: str) -> Injected:
    """Add `return_token_ids` and sampling `logprobs` to the upstream `body` (in place) if absent."""
    inj = Injected()
    if body.get("return_token_ids") is not True:
        body["return_token_ids"] = True
        inj.token_ids = True
    if endpoint == CHAT:
        if body.get("logprobs") is not True:
            body["logprobs"] = True
            inj.logprobs = True
    elif body.get("logprobs") is None:
        body["logprobs"] = 0  # the sampled token's logprob only, no alternatives
        inj.logprobs = True
    return inj


def _choice_logprobs(choice: dict, endpoint: str) -> list | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if endpoint == CHAT:
        content = lp.get("content")
        return [e.get("logprob") for e in content] if content is not None else None
    return lp.get("token_logprobs")


def strip(obj: dict, inj: Injected) -> None:
    """Take the injected fields out of a response or stream chunk (in place): token ids are not
    OpenAI's fields, so their keys go; `logprobs` is, and is null when not asked for."""
    if inj.token_ids:
        obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or ():
        if inj.token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if inj.logprobs and "logprobs" in choice:
            choice["logprobs"] = None


Captured = CompletionRecord  # what capture fills in: response, token ids, logprobs, finish, counts


def choice_prompts(top: list | None, per_choice: list[list | None]) -> list | None:
    """The stored `prompt_token_ids`: one list when every choice has the same prompt (chat, n > 1),
    else one list per choice (a batched /v1/completions `prompt: [...]`: each choice has its own)."""
    if top is not None:
        return top
    found = [p for p in per_choice if p is not None]
    if not found:
        return None
    if len(found) == len(per_choice) and all(p == found[0] for p in found):
        return found[0]
    return list(per_choice)


def _ints(value: object) -> bool:
    """None, or a list of integers (bools are not). Runs on every stream chunk: a plain loop (a
    generator cost more than the check for the usual one-token list)."""
    if value is None:
        return True
    if type(value) is not list:
        return isinstance(value, list) and all(type(t) is int for t in value)
    for t in value:
        if type(t) is not int:
            return False
    return True


def _dicts(value: object) -> bool:
    """A list of objects (one per sampled token for logprobs: a loop, not a generator)."""
    if not isinstance(value, list):
        return False
    for e in value:
        if not isinstance(e, dict):
            return False
    return True


def shape_problem(resp: object, endpoint: str) -> str | None:
    """What makes `resp` (a parsed 200 body) no completion of `endpoint`'s shape, or None.

    Checked: an object with a `choices` list of objects; chat choices' `message` an object whose
    `content` is text or null and `tool_calls` a list of objects with a `function` object; text
    completions' `text` a string; `token_ids`/`prompt_token_ids` lists of integers; `logprobs` an
    object (chat: `content` a list of objects); `usage` an object. Counts are coerced elsewhere.
    """
    if not isinstance(resp, dict):
        return "the body is not a JSON object"
    choices = resp.get("choices")
    if not isinstance(choices, list):
        return "choices is not a list"
    if not _ints(resp.get("prompt_token_ids")):
        return "prompt_token_ids is not a list of integers"
    usage = resp.get("usage")
    if usage is not None and not isinstance(usage, dict):
        return "usage is not an object"
    for i, c in enumerate(choices):
        if not isinstance(c, dict):
            return f"choices[{i}] is not an object"
        if not _ints(c.get("token_ids")):
            return f"choices[{i}].token_ids is not a list of integers"
        if not _ints(c.get("prompt_token_ids")):
            return f"choices[{i}].prompt_token_ids is not a list of integers"
        lp = c.get("logprobs")
        if lp is not None and not isinstance(lp, dict):
            return f"choices[{i}].logprobs is not an object"
        if endpoint == CHAT:
            msg = c.get("message")
            if not isinstance(msg, dict):
                return f"choices[{i}].message is not an object"
            if msg.get("content") is not None and not isinstance(msg["content"], str):
                return f"choices[{i}].message.content is not a string"
            calls = msg.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    return f"choices[{i}].message.tool_calls is not a list"
                for j, tc in enumerate(calls):
                    if not isinstance(tc, dict) or not isinstance(tc.get("function", {}), dict):
                        return f"choices[{i}].message.tool_calls[{j}] is not a tool call object"
            content = lp.get("content") if lp else None
            if content is not None and not _dicts(content):
                return f"choices[{i}].logprobs.content is not a list of objects"
        elif c.get("text") is not None and not isinstance(c["text"], str):
            return f"choices[{i}].text is not a string"
    return None


def coerce_usage(resp: dict) -> None:
    """Token counts of `resp["usage"]` as integers, or None where they are not numbers (in place)."""
    usage = resp.get("usage")
    if isinstance(usage, dict):
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            if k in usage and type(usage[k]) is not int:
                usage[k] = as_count(usage[k])


def from_response(resp: dict, endpoint: str, inj: Injected, cap: Captured | None = None) -> Captured:
    """Capture a non-streaming response into `cap` (a new record if None), then strip it for the
    client (in place: it is also stored)."""
    choices = resp.get("choices") or []
    token_ids = [c.get("token_ids") for c in choices]
    logprobs = [_choice_logprobs(c, endpoint) for c in choices]
    cap = cap if cap is not None else Captured(None)
    cap.prompt_token_ids = choice_prompts(
        resp.get("prompt_token_ids"), [c.get("prompt_token_ids") for c in choices]
    )
    cap.token_ids, cap.logprobs = token_ids, logprobs
    cap.finish_reason = choices[0].get("finish_reason") if choices else None
    usage = resp.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    cap.prompt_tokens = as_count(usage.get("prompt_tokens"))
    cap.completion_tokens = as_count(usage.get("completion_tokens"))
    if inj.any:
        strip(resp, inj)
    cap.response = resp
    return cap


@dataclass(slots=True)
class _Choice:
    index: int
    role: str | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprob_entries: list = field(default_factory=list)  # as the client asked for them (if it did)
    finish_reason: str | None = None
    stop_reason: object = None
    prompt_token_ids: list | None = None


class StreamAssembler:
    """Fold the chunks of a stream into one stored response (chat or completions shape)."""

    def __init__(self, endpoint: str, inj: Injected) -> None:
        self.endpoint = endpoint
        self.inj = inj
        self.head: dict = {}
        self.choices: dict[int, _Choice] = {}
        self.prompt_token_ids: list | None = None
        self.usage: dict | None = None
        self.got_token = False  # a chunk carrying generated text or tokens arrived (for ttft)
        self.malformed = False  # a part of a chunk was not of the OpenAI shape (skipped)
        self._chat = endpoint == CHAT
        self._keep_entries = not inj.logprobs  # the client asked for logprobs: rebuild them

    def feed(self, chunk: dict, strip: bool = False) -> bool:
        """Fold one parsed `data:` chunk in. With `strip`, also take the injected fields out of
        `chunk` (in place, as `strip()` does) and say whether the chunk is left empty: it
        carried only the injected fields, so the upstream would not have sent it at all (vLLM and
        the embedded engine emit a chunk per sampled token when token ids or logprobs are asked
        for, even one that adds no text, `"delta": {}`; without them they skip it). The client's
        stream then drops it, and stays as it would have been. Without `strip`: False.

        Runs for every token of every stream: one pass over the chunk, one `get` per field (each
        read serves the fold, the strip and the emptiness), and nothing kept that the result will
        not use (the client's own logprob entries only when it asked). A part that is not of the
        OpenAI shape is skipped and marks the stream `malformed`; the chunk is then not empty.
        """
        get = chunk.get
        if not self.head:
            self.head = {k: get(k) for k in ("id", "created", "model", "system_fingerprint")}
        strip_ids = strip and self.inj.token_ids
        strip_lp = strip and self.inj.logprobs
        p = get("prompt_token_ids")
        if p is not None and _ints(p):
            self.prompt_token_ids = p
        if strip_ids:
            chunk.pop("prompt_token_ids", None)
        usage = get("usage")
        if usage:
            if type(usage) is dict:
                self.usage = usage
        choices = get("choices")
        if not choices:
            return False
        if type(choices) is not list:
            self.malformed = True
            return False
        empty = strip and not usage
        chat = self._chat
        for c in choices:
            if type(c) is not dict:  # not a choice: nothing of it can be kept
                self.malformed = True
                empty = False
                continue
            cg = c.get
            idx = cg("index", 0)
            if type(idx) is not int:
                idx = 0
            ch = self.choices.get(idx)
            if ch is None:
                ch = self.choices[idx] = _Choice(idx)
            p = cg("prompt_token_ids")
            if p is not None and ch.prompt_token_ids is None and _ints(p):
                ch.prompt_token_ids = p
            if strip_ids:
                c.pop("prompt_token_ids", None)
            ids = cg("token_ids")
            if ids is not None:
                if ids:
                    if _ints(ids):
                        ch.token_ids.extend(ids)
                        self.got_token = True
                    else:
                        self.malformed = True
                if not strip_ids:
                    empty = False
            if strip_ids:
                c.pop("token_ids", None)
            lp = cg("logprobs")
            if lp is not None:
                if lp and type(lp) is dict:
                    if chat:
                        for e in lp.get("content") or ():
                            if type(e) is dict:
                                ch.logprobs.append(e.get("logprob"))
                                if self._keep_entries:
                                    ch.logprob_entries.append(e)
                    else:
                        tl = lp.get("token_logprobs")
                        if type(tl) is list:
                            ch.logprobs.extend(tl)
                        if self._keep_entries:
                            ch.logprob_entries.append(lp)
                if strip_lp:
                    c["logprobs"] = None
                else:
                    empty = False
            fr = cg("finish_reason")
            if fr is not None:
                ch.finish_reason = fr
                empty = False
            sr = cg("stop_reason")
            if sr is not None:
                ch.stop_reason = sr
            delta = cg("delta") if chat or empty else None
            if delta:
                if type(delta) is not dict:
                    self.malformed = self.malformed or chat  # (a text completion has no delta to read)
                    empty = False
                else:
                    if chat:
                        self._delta(ch, delta)
                    if empty:
                        for v in delta.values():
                            if v:
                                empty = False
                                break
            text = cg("text") if not chat or empty else None
            if text:
                empty = False
                if not chat:
                    ch.text.append(str(text))
                    self.got_token = True
        return empty

    def _delta(self, ch: _Choice, delta: dict) -> None:
        get = delta.get
        role = get("role")
        if role:
            ch.role = str(role)
        content = get("content")
        if content:
            ch.text.append(content if type(content) is str else str(content))
            self.got_token = True
        reasoning = get("reasoning") or get("reasoning_content")
        if reasoning:
            ch.reasoning.append(str(reasoning))
        calls = get("tool_calls")
        if not calls:
            return
        for tc in calls if isinstance(calls, list) else ():
            if not isinstance(tc, dict):
                self.malformed = True
                continue
            i = tc.get("index", 0)
            if type(i) is not int:
                i = 0
            slot = ch.tool_calls.get(i)
            if slot is None:
                slot = ch.tool_calls[i] = {
                    "id": None,
                    "type": "function",
                    "function": {"name": "", "arguments": ""},
                }
            if tc.get("id"):
                slot["id"] = tc["id"]
            if tc.get("type"):
                slot["type"] = tc["type"]
            fn = tc.get("function") or {}
            if not isinstance(fn, dict):
                self.malformed = True
                continue
            if fn.get("name"):
                slot["function"]["name"] += str(fn["name"])
            if fn.get("arguments"):
                slot["function"]["arguments"] += str(fn["arguments"])
            self.got_token = True

    def result(self, cap: Captured | None = None) -> Captured:
        """The assembled response and capture fields (a partial one if the stream was cut), in `cap`
        (a new record if None)."""
        chat = self.endpoint == CHAT
        choices = [self.choices[i] for i in sorted(self.choices)]
        out = []
        for ch in choices:
            logprobs = None
            if not self.inj.logprobs and ch.logprob_entries:
                if chat:
                    logprobs = {"content": ch.logprob_entries}
                else:
                    logprobs = _merge_completion_logprobs(ch.logprob_entries)
            if chat:
                message: dict = {"role": ch.role or "assistant", "content": "".join(ch.text)}
                if ch.reasoning:
                    message["reasoning_content"] = "".join(ch.reasoning)
                if ch.tool_calls:
                    message["tool_calls"] = [ch.tool_calls[i] for i in sorted(ch.tool_calls)]
                item = {"index": ch.index, "message": message, "logprobs": logprobs}
            else:
                item = {"index": ch.index, "text": "".join(ch.text), "logprobs": logprobs}
            item["finish_reason"] = ch.finish_reason
            item["stop_reason"] = ch.stop_reason
            if not self.inj.token_ids:
                item["token_ids"] = ch.token_ids
            out.append(item)
        response = {
            "id": self.head.get("id"),
            "object": "chat.completion" if chat else "text_completion",
            "created": self.head.get("created"),
            "model": self.head.get("model"),
            "choices": out,
            "usage": self.usage,
        }
        prompt_ids = choice_prompts(self.prompt_token_ids, [ch.prompt_token_ids for ch in choices])
        if not self.inj.token_ids and prompt_ids is not None:
            response["prompt_token_ids"] = prompt_ids
        cap = cap if cap is not None else Captured(None)
        cap.response, cap.prompt_token_ids = response, prompt_ids
        cap.token_ids = [ch.token_ids for ch in choices]
        cap.logprobs = [ch.logprobs for ch in choices]
        cap.finish_reason = choices[0].finish_reason if choices else None
        if self.usage:
            cap.prompt_tokens = as_count(self.usage.get("prompt_tokens"))
            cap.completion_tokens = as_count(self.usage.get("completion_tokens"))
        else:  # no usage chunk unless the client asked for one: count the captured tokens
            cap.prompt_tokens = _count_prompt_tokens(prompt_ids)
            cap.completion_tokens = sum(len(ch.token_ids) for ch in choices) if choices else None
        return cap


def _count_prompt_tokens(prompt_ids: list | None) -> int | None:
    if prompt_ids is None:
        return None
    if prompt_ids and isinstance(prompt_ids[0], list) or None in prompt_ids:  # one list per choice
        return sum(len(p) for p in prompt_ids if p is not None)
    return len(prompt_ids)


def _merge_completion_logprobs(parts: list[dict]) -> dict:
    merged: dict = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for p in parts:
        for key in merged:
            merged[key].extend(p.get(key) or ())
    return merged
