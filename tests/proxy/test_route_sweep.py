"""The bad-input sweep (issue 55): every route, every parameter, client-controlled values only, and
never a 5xx.

The routes are read from what serves them, not listed by hand: FastAPI's `app.routes` (path
parameters, and query parameters from each endpoint's signature), the hot routes `HotPath` serves
before FastAPI (`routes_openai.ROUTES`, plain and under `/runs/{run_id}/`, and the reward routes),
and the patterns of `rules.RULES` with each `*` filled in. Each example picks one route and one
method, fills every path and query parameter (and a JSON body on writes) from a pool of hostile
values: integers past 64 bits, negative, Unicode digits, U+0000, very long strings, wrong JSON
types, deep nesting. First systematically (every parameter of every route takes every value of
`HOSTILE` while the others stay plain, every write route every body of `HOSTILE_BODIES`), then
hypothesis draws combinations of them. The proxy is a real uvicorn server on a stub upstream (no
keys: every route open, so every handler is reached). test_fuzz.py draws the bodies of the hot
routes in depth; this one is wide, not deep.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlproxy.proxy.routes_openai import ROUTES
from rlproxy.proxy.rules import RULES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SWEEP = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

HOSTILE = [
    "0",
    "-1",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775809",
    "18446744073709551616",
    "1" * 400,
    "1e309",
    "NaN",
    "-inf",
    "²",
    "١٢٣",
    "\x00",
    "a\x00b",
    "\ud800",
    "x" * 5000,
    "",
    " ",
    "..",
    "../../etc/passwd",
    "%00",
    "null",
    "true",
    "[]",
    "{}",
    "stub-model@²",
    "stub-model@99999999999999999999",
    "stub-model@-1",
    "'; DROP TABLE runs; --",
    "🙂" * 50,
]
texts = st.sampled_from(HOSTILE) | st.text(max_size=40)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
# the fields the proxy's routes read, filled with anything
FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "stream",
    "max_tokens",
    "reward",
    "metrics",
    "metadata",
    "rubric",
    "split",
    "judge",
    "previous_response_id",
    "tools",
    "system",
]
bodies = (
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5)
    | json_values
    | st.integers(min_value=1, max_value=2000).map(lambda d: "[" * d + "]" * d)  # raw, nested deep
)


def _fastapi(app: Any) -> FastAPI:
    while not isinstance(app, FastAPI):
        app = app.app
    return app


def _flat(routes: list[Any]) -> list[Any]:
    """FastAPI's routes with included routers opened (compose.py includes them without a prefix)."""
    out = []
    for route in routes:
        included = getattr(route, "original_router", None)
        out.extend(_flat(included.routes) if included is not None else [route])
    return out


def _routes(app: Any) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(path template, methods, query parameter names) of every route the proxy serves."""
    out = []
    for route in _flat(_fastapi(app).routes):
        methods = tuple(sorted(getattr(route, "methods", None) or {"GET"}))
        dependant = getattr(route, "dependant", None)
        query = tuple(p.name for p in dependant.query_params) if dependant is not None else ()
        out.append((route.path, methods, query))
    for route in ROUTES:  # HotPath's, before FastAPI
        out.append((f"/{route}", ("POST",), ()))
        out.append((f"/runs/{{run_id}}/{route}", ("POST",), ()))
    for action in ("reward", "complete"):
        out.append((f"/v1/runs/{{run_id}}/{action}", ("POST",), ()))
        out.append((f"/runs/{{run_id}}/v1/{action}", ("POST",), ()))
        out.append((f"/runs/{{run_id}}/v1/runs/{{named}}/{action}", ("POST",), ()))
    for rule in RULES:
        for pattern in rule.patterns:
            out.append((pattern.replace("*", "{star}"), ("GET", "POST"), ()))
    return out


HOSTILE_BODIES = [
    b"",
    b"null",
    b"[]",
    b'"x"',
    b"18446744073709551616",
    b"{",
    b"[" * 3000 + b"]" * 3000,
    json.dumps({"model": 2**64, "messages": "x", "reward": "1", "input": []}).encode(),
    json.dumps({"model": "stub-model@\u00b2", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    json.dumps({"reward": 2**64, "metrics": [], "metadata": "x", "split": 7}).encode(),
    json.dumps({"rubric": ["x"], "judge": "yes", "previous_response_id": 12}).encode(),
    json.dumps({"model": "stub-model", "input": "hi", "previous_response_id": "x" * 5000}).encode(),
]
PLAIN = "x"


def _fill(template: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)(?::path)?\}", lambda m: _enc(values.get(m.group(1), PLAIN)) or PLAIN, template)


def _enc(value: str) -> str:
    """Percent-encoded as a client sends it (a lone surrogate as its UTF-8 bytes)."""
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


def _check(resp: httpx.Response, what: str) -> None:
    assert resp.status_code < 500, f"{what} -> {resp.status_code}: {resp.text[:300]}"
    if resp.status_code >= 400 and resp.headers.get("content-type", "").startswith("application/json"):
        body = resp.json()
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict) and isinstance(err.get("message"), str), f"{what}: {body}"


@pytest.fixture
def served(make_proxy: Any, stub: Any) -> Any:
    proxy = make_proxy(stub.url, max_body_bytes=256 * 1024, upstream_timeout=5.0)
    with httpx.Client(base_url=proxy.url, timeout=30.0) as client:
        yield client, _routes(proxy.app)


def test_every_parameter_of_every_route_takes_every_hostile_value(served: Any) -> None:
    client, routes = served
    failed = []

    def send(method: str, url: str, body: bytes | None = None) -> None:
        headers = {"content-type": "application/json"} if body is not None else {}
        resp = client.request(method, url, content=body, headers=headers)
        if resp.status_code >= 500:
            failed.append(f"{method} {url[:200]} {body[:80] if body else ''!r} -> {resp.status_code}")

    for template, methods, query in routes:
        method = "POST" if "POST" in methods else methods[0]
        body = b"{}" if method == "POST" else None
        names = re.findall(r"\{(\w+)(?::path)?\}", template)
        for name in names:
            for value in HOSTILE:
                send(method, _fill(template, {name: value}), body)
        for name in query:
            for value in HOSTILE:
                send(method, f"{_fill(template, {})}?{_enc(name)}={_enc(value)}", body)
        if method == "POST":
            for raw in HOSTILE_BODIES:
                send(method, _fill(template, {}), raw)
    assert not failed, "\n".join(failed)


@SWEEP
@given(data=st.data())
def test_no_client_value_on_any_route_is_a_5xx(served: Any, data: st.DataObject) -> None:
    client, routes = served
    template, methods, query = data.draw(st.sampled_from(routes), label="route")
    method = data.draw(st.sampled_from(methods), label="method")
    if method == "HEAD":
        method = "GET"

    # every path parameter (never an empty segment) and some query parameters
    path = _fill(
        template, {n: data.draw(texts, label=n) for n in re.findall(r"\{(\w+)(?::path)?\}", template)}
    )
    params = [
        f"{_enc(name)}={_enc(data.draw(texts, label=name))}" for name in query if data.draw(st.booleans())
    ]
    if params:
        path += "?" + "&".join(params)
    headers: dict[str, bytes] = {}
    for header in ("X-Run-Id", "X-Group-Id", "X-Split"):
        if data.draw(st.booleans(), label=header):
            value = data.draw(st.sampled_from(HOSTILE[:12]) | st.text(alphabet="abc-_.:09", max_size=200))
            headers[header] = value.encode("latin-1", "replace")
    content = None
    if method in ("POST", "PUT", "PATCH"):
        body = data.draw(bodies, label="body")
        content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        headers["content-type"] = b"application/json"
    what = f"{method} {path} {headers} {content[:200] if content else None!r}"
    try:
        resp = client.request(method, path, headers=headers, content=content)
    except httpx.LocalProtocolError:  # a header value httpx itself will not send
        return
    _check(resp, what)
