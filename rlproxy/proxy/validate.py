"""A quick check of the few request fields the proxy reads, without building a pydantic model.

The upstream validates the rest. This only rejects what would make the proxy itself misbehave or
what OpenAI's API rejects as a type error: 400 for a body that is not JSON or is nested deeper than
`max_json_depth`, 422 (OpenAI's error shape, `param` naming the field) for a wrong type. Cheap on
purpose: it runs on every request (the depth is walked only when the body has more brackets than
the limit, which an ordinary request has not).

Text the store cannot hold is refused here, at the edge, in every route that reads a body (issue 22,
cases 4 and 6): a lone UTF-16 surrogate (`"\ud800"`: no UTF-8 form; orjson refuses it as invalid
JSON, and the reward route's NaN-tolerant fallback parser is checked for it) and U+0000 (`"\u0000"`:
PostgreSQL's text and jsonb cannot hold it; refused on every store, so an app behaves the same on
SQLite and PostgreSQL and a store can move from one to the other). Both are a 400 `invalid_text`.
The U+0000 check is a byte search for its escape, walked only on a hit.
"""

from __future__ import annotations

import json
from typing import Annotated

import orjson
from fastapi import Query

from rlproxy.errors import APIError
from rlproxy.storage.records import Endpoint

# An integer query parameter (an id, a position, a limit): FastAPI takes any integer, the store binds
# 64 bits, so a larger one was a 500 (issue 55); out of this range it is the 422 of a bad value.
Int64 = Annotated[int, Query(ge=-(2**63), le=2**63 - 1)]
OptInt64 = Annotated[int | None, Query(ge=-(2**63), le=2**63 - 1)]

_INT = (int,)
_NUM = (int, float)

# field -> (allowed types, human name); bool is rejected where an int or number is wanted
_COMMON: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "a string"),
    "stream": ((bool,), "a boolean"),
    "n": (_INT, "an integer"),
    "max_tokens": (_INT, "an integer"),
    "max_completion_tokens": (_INT, "an integer"),
    "temperature": (_NUM, "a number"),
    "top_p": (_NUM, "a number"),
    "seed": (_INT, "an integer"),
    "return_token_ids": ((bool,), "a boolean"),
    "stop": ((str, list), "a string or a list of strings"),
    "stream_options": ((dict,), "an object"),
}
_CHAT = {
    **_COMMON,
    "tools": ((list,), "a list"),
    "logprobs": ((bool,), "a boolean"),
    "top_logprobs": (_INT, "an integer"),
}
_COMPLETIONS = {**_COMMON, "logprobs": (_INT, "an integer"), "prompt": ((str, list), "a string or a list")}


def _wrong(field: str, want: str) -> APIError:
    return APIError(422, f"{field}: must be {want}", param=field, code="invalid_type")


MAX_DEPTH = 64  # the default of `max_json_depth`; orjson itself cannot write past 254 levels


def parse_body(raw: bytes, max_depth: int = MAX_DEPTH, non_finite: bool = False) -> dict:
    """The JSON object in `raw`; 400 if it is not JSON or nests deeper than `max_depth` levels, 422 if
    it is JSON but not an object. `non_finite`: also accept the NaN/Infinity literals orjson refuses
    (so that a reward of NaN gets the 422 it deserves rather than a 400)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        body = _loads_non_finite(raw) if non_finite else None
        if body is None:
            raise APIError(
                400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
            ) from None
    if not isinstance(body, dict):
        raise APIError(422, "the request body must be a JSON object", code="invalid_type")
    if b"\\u0000" in raw and _bad_text(body, "\x00"):  # a raw NUL byte is not JSON: only the escape
        raise APIError(
            400, "the body holds U+0000 (a NUL character), which the store cannot hold", code="invalid_text"
        )
    # nesting cannot exceed the number of brackets: count them in C before walking in Python
    if raw.count(b"{") + raw.count(b"[") > max_depth and _deeper_than(body, max_depth):
        raise APIError(400, f"the JSON body is nested deeper than {max_depth} levels", code="json_too_deep")
    return body


def _loads_non_finite(raw: bytes) -> object | None:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if _bad_text(body, None):  # json.loads accepts lone surrogates, which orjson refuses
        raise APIError(
            400,
            "the body holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text the store can hold",
            code="invalid_text",
        )
    return body


def _bad_text(value: object, char: str | None) -> bool:
    """True if a string (key or value) in `value` holds `char`, or (None) a lone surrogate."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if (char in node) if char is not None else not _utf8(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _deeper_than(value: object, max_depth: int) -> bool:
    """True if `value` holds containers nested more than `max_depth` deep (itself is level 1)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        for child in children:  # type: ignore[union-attr]
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def _mistyped(value: object, types: tuple) -> bool:
    return not isinstance(value, types) or (isinstance(value, bool) and bool not in types)


def check(body: dict, endpoint: Endpoint) -> None:
    """422 APIError for the first field of the wrong type (`endpoint`: which route)."""
    rules = _CHAT if endpoint == Endpoint.CHAT else _COMPLETIONS
    for field, value in body.items():  # the body's few fields, not every rule (on every request)
        rule = rules.get(field)
        if rule is not None and value is not None and _mistyped(value, rule[0]):
            for name, (types, want) in rules.items():  # the first wrong one in the rules' order
                if (v := body.get(name)) is not None and _mistyped(v, types):
                    raise _wrong(name, want)
    n = body.get("n")
    if n is not None and n < 1:
        raise APIError(422, "n: must be at least 1", param="n", code="invalid_value")
    if endpoint == Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _wrong("messages", "a non-empty list of message objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _wrong(f"messages[{i}]", "an object with a string `role`")
    elif body.get("prompt") is None:
        raise _wrong("prompt", "a string or a list")


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


async def read_body(receive, declared: bytes | None, limit: int) -> bytes:
    """The raw request body from ASGI `receive`; 413 as soon as it is known to exceed `limit` bytes."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413,
            f"request body of {declared.decode()} bytes exceeds the limit of {limit}",
            code="body_too_large",
        )
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            body = body + chunk if body else chunk
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        if not message.get("more_body", False):
            return body
