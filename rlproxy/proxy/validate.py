"""A quick check of the few request fields the proxy reads, without building a pydantic model.

The upstream validates the rest. This only rejects what would make the proxy itself misbehave or
what OpenAI's API rejects as a type error: 400 for a body that is not a JSON object, 422 (OpenAI's
error shape, `param` naming the field) for a wrong type. Cheap on purpose: it runs on every request.
"""

from __future__ import annotations

import orjson

from rlproxy.errors import APIError

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


def parse_body(raw: bytes) -> dict:
    """The JSON object in `raw`; 400 if it is not JSON, 422 if it is JSON but not an object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise APIError(422, "the request body must be a JSON object", code="invalid_type")
    return body


def check(body: dict, endpoint: str) -> None:
    """422 APIError for the first field of the wrong type (`endpoint`: chat.completions|completions)."""
    rules = _CHAT if endpoint == "chat.completions" else _COMPLETIONS
    for field, (types, want) in rules.items():
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise _wrong(field, want)
    n = body.get("n")
    if n is not None and n < 1:
        raise APIError(422, "n: must be at least 1", param="n", code="invalid_value")
    if endpoint == "chat.completions":
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
