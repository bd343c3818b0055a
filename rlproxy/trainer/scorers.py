"""Scorers: what compares the K answers of a sibling group and gives each a number (docs/siblings.md).

A scorer is told the app's request (the conversation up to the call, the tools it offered) and the K
candidate answers, and returns K finite numbers; only their differences train. A scorer that fails,
times out or answers nonsense raises `ScorerError` (one line): the group waits and is tried again,
then fails, visibly; it is never trained on a guess. One `score` call is one attempt (the caller
counts them: `scorer_max_attempts`).

    checks   built in (`check_scores`, pure): each candidate's share of the checks that apply to it:
             tools (offered): no unparsed `<tool_call>` markup; every call names an offered tool (the
                 one `tool_choice` names) with a JSON object valid against its `parameters` schema
                 (`jsonschema`); no call counts only under tool_choice "required"/named (a failure);
                 tool_choice "none" fails any call
             json (`response_format` json_object / json_schema, a candidate without tool calls): the
                 content is a JSON object / valid against the schema
             cut (always): `finish_reason` is not "length"
    url      the app's endpoint (`scorer_url`, or a key's own): POST `wire_body` with `Authorization:
             Bearer <scorer_api_key>`; it answers 200 `{"scores": [K finite numbers]}`
    judge    the judge model (trainer/judge.py: its client, endpoint and parsing), shown the turn's
             conversation and the K candidates side by side with a turn rubric

`scorer_checks_weight` w > 0 mixes the checks into url or judge: (1 - w) * primary + w * checks.

(A little over 400 lines: the three scorers share `ScoreRequest`, `chat_form` and the checks that
each can mix in; apart, each file would hold a fragment of the one contract.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import jsonschema
import referencing

from rlproxy.errors import ConfigError, RLProxyError
from rlproxy.settings import JudgeSettings, Settings
from rlproxy.trainer.judge import RETRY_TEMPERATURE, Judge, JudgeUnavailable
from rlproxy.trainer.judge_prompt import DEFAULT_TURN_RUBRIC, JudgeOutputError, build_turn_messages
from rlproxy.wire import messages as wire_messages
from rlproxy.wire import responses as wire_responses

log = logging.getLogger(__name__)

TOOL_OPEN = "<tool_call>"


class ScorerError(RLProxyError):
    """A scorer failed, timed out or answered nonsense (the message says which, in one line)."""


@dataclass
class ScoreRequest:
    """One sibling group (or shadow pair) to score."""

    group_id: str
    policy: str
    endpoint: str | None  # completions.endpoint of the branched call
    request: dict[str, Any]  # the app's stored request body (messages, tools, response_format, max_tokens)
    candidates: list[dict[str, Any]]  # resample.as_message dicts: role, content, tool_calls, finish_reason
    scorer_url: str | None = None  # a key's own scorer, else settings.scorer_url


class Scorer(Protocol):
    """Gives each candidate of a request a finite number; raises ScorerError."""

    name: str

    async def score(self, req: ScoreRequest) -> list[float]: ...


# ---------------------------------------------------------------------- the request's chat form


def _is_messages_body(body: dict[str, Any]) -> bool:
    """An Anthropic Messages body (not its stored chat form): top-level `system`, `input_schema` tools
    or content blocks only Messages has."""
    if "system" in body or any(isinstance(t, dict) and "input_schema" in t for t in body.get("tools") or ()):
        return True
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result") for b in content
        ):
            return True
    return False


def chat_form(request: dict[str, Any]) -> dict[str, Any]:
    """The request as a chat-completions body. `completions.request` already is one for every endpoint;
    a raw Responses (`input`) or Messages body is converted with `wire/`; one that does not convert is
    used as it is."""
    try:
        if "input" in request and "messages" not in request:
            return wire_responses.chat_request(request)
        if _is_messages_body(request):
            return wire_messages.chat_request({"model": "", "max_tokens": 1, **request})
    except (wire_responses.ResponsesInputError, wire_messages.MessagesInputError) as exc:
        log.info("scorer: request not converted to chat form (%s); used as it is", exc)
    return request


# ---------------------------------------------------------------------- the built-in checks


def _offered_tools(tools: Any) -> dict[str, Any]:
    """name -> parameters schema (None: any object) of the offered tools: chat
    `{"type": "function", "function": {name, parameters}}`, Responses `{"type": "function", name,
    parameters}` or Messages `{name, input_schema}`."""
    out: dict[str, Any] = {}
    for t in tools if isinstance(tools, list) else ():
        if not isinstance(t, dict):
            continue
        spec = t.get("function") if isinstance(t.get("function"), dict) else t
        name = spec.get("name")
        if isinstance(name, str):
            out[name] = spec.get("parameters", spec.get("input_schema"))
    return out


def _tool_choice(choice: Any) -> tuple[bool, str | None, bool]:
    """(a call is required, the one tool it must name or None, calls are forbidden) of `tool_choice`
    in its chat, Responses or Messages shape."""
    if choice in ("required", "any"):
        return True, None, False
    if choice == "none":
        return False, None, True
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "any":
            return True, None, False
        if kind == "none":
            return False, None, True
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        if kind in ("function", "tool") and isinstance(fn.get("name"), str):
            return True, fn["name"], False
    return False, None, False


def _fits(value: Any, schema: Any) -> bool:
    """`value` is valid against the JSON schema (a schema that cannot be used checks nothing)."""
    if not isinstance(schema, dict | bool):
        return True
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls(schema, registry=referencing.Registry()).validate(value)  # a remote $ref is never fetched
    except jsonschema.ValidationError:
        return False
    except Exception as exc:  # a schema that is itself wrong, or a $ref that cannot be resolved
        log.debug("scorer checks: schema not usable (%s): not checked", exc)
    return True


def _loads(text: Any) -> tuple[bool, Any]:
    if not isinstance(text, str):
        return False, None
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def _tool_check(
    cand: dict[str, Any], tools: dict[str, Any], choice: tuple[bool, str | None, bool]
) -> bool | None:
    """True / False, or None when the tools check does not apply to this candidate."""
    required, named, forbidden = choice
    content = cand.get("content")
    if isinstance(content, str) and TOOL_OPEN in content:
        return False  # markup the parser could not read
    calls = cand.get("tool_calls") or []
    if not calls:
        return False if required else None
    if forbidden:
        return False
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in tools or (named is not None and name != named):
            return False
        args = fn.get("arguments")
        ok, value = _loads(args) if isinstance(args, str) else (True, args)
        if not ok or not isinstance(value, dict) or not _fits(value, tools[name]):
            return False
    return True


def _json_check(cand: dict[str, Any], fmt: Any) -> bool | None:
    """True / False, or None when `response_format` asks no JSON or the candidate calls a tool."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("json_object", "json_schema") or cand.get("tool_calls"):
        return None
    ok, value = _loads(cand.get("content"))
    if not ok:
        return False
    if kind == "json_object":
        return isinstance(value, dict)
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return _fits(value, schema) if schema is not None else True


def check_scores(req: ScoreRequest) -> list[float]:
    """The built-in checks: each candidate's share of the checks that apply to it, in [0, 1]."""
    chat = chat_form(req.request)
    tools = _offered_tools(chat.get("tools"))
    choice = _tool_choice(chat.get("tool_choice"))
    out = []
    for cand in req.candidates:
        results = [cand.get("finish_reason") != "length"]
        for result in (
            _tool_check(cand, tools, choice) if tools else None,
            _json_check(cand, chat.get("response_format")),
        ):
            if result is not None:
                results.append(result)
        out.append(sum(results) / len(results))
    return out


class ChecksScorer:
    """The built-in checks alone."""

    name = "checks"

    async def score(self, req: ScoreRequest) -> list[float]:
        return check_scores(req)


# ---------------------------------------------------------------------- the app's scorer (url)


def wire_body(req: ScoreRequest) -> dict[str, Any]:
    """What the url scorer is sent: this group's conversation, tools and candidates, nothing else.

    `messages` is the request's chat form (`chat_form`); a `/v1/completions` call has none: [] and its
    text prompt as `prompt`."""
    chat = chat_form(req.request)
    body: dict[str, Any] = {
        "group_id": req.group_id,
        "policy": req.policy,
        "endpoint": req.endpoint,
        "messages": chat.get("messages") if isinstance(chat.get("messages"), list) else [],
        "tools": chat.get("tools") or None,
        "response_format": chat.get("response_format"),
        "max_tokens": chat.get("max_tokens", chat.get("max_completion_tokens")),
        "candidates": [
            {
                "index": i,
                "content": c.get("content"),
                "tool_calls": c.get("tool_calls") or None,
                "finish_reason": c.get("finish_reason"),
            }
            for i, c in enumerate(req.candidates)
        ],
    }
    if isinstance(chat.get("prompt"), str) and "messages" not in chat:
        body["prompt"] = chat["prompt"]
    return body


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


def read_scores(raw: bytes, k: int) -> list[float]:
    """The K scores of a url scorer's 200 answer; ScorerError unless `{"scores": [K finite numbers]}`."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise ScorerError(
            f"scorer answer is not JSON: {_one_line(raw[:200].decode('utf-8', 'replace'))!r}"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("scores"), list):
        raise ScorerError('scorer answer is not an object with a "scores" list')
    scores = data["scores"]
    if len(scores) != k:
        raise ScorerError(f"scorer answered {len(scores)} scores for {k} candidates")
    for i, s in enumerate(scores):
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s):
            raise ScorerError(f"scorer score {i} is {s!r}, not a finite number")
    return [float(s) for s in scores]


class UrlScorer:
    """The app's scorer: one POST per group, bounded in time and size."""

    name = "url"

    def __init__(
        self, client: httpx.AsyncClient, url: str | None, api_key: str | None, timeout: float, max_bytes: int
    ) -> None:
        self.client, self.url, self.api_key = client, url, api_key
        self.timeout, self.max_bytes = timeout, max_bytes

    async def score(self, req: ScoreRequest) -> list[float]:
        url = req.scorer_url or self.url
        if not url:
            raise ScorerError("no scorer url: set scorer_url")
        # scorer_api_key is the operator's secret for scorer_url: never sent to a key's own scorer
        own = req.scorer_url is not None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key and not own else {}
        try:
            async with asyncio.timeout(self.timeout):  # the whole call, a trickled answer included
                status, raw = await self._post(url, wire_body(req), headers)
        except (TimeoutError, httpx.TimeoutException):
            raise ScorerError(f"scorer did not answer within scorer_timeout ({self.timeout:g} s)") from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # connection, protocol, a key's bad url
            raise ScorerError(f"scorer call failed: {type(exc).__name__}: {_one_line(str(exc))}") from exc
        if status != 200:
            text = _one_line(raw[:200].decode("utf-8", "replace"))
            raise ScorerError(f"scorer answered HTTP {status}: {text}")
        return read_scores(raw, len(req.candidates))

    async def _post(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes]:
        """(status, body) of one POST, the body read up to `max_bytes` (more: ScorerError)."""
        too_large = ScorerError(f"scorer answer is larger than scorer_max_bytes ({self.max_bytes})")
        async with self.client.stream("POST", url, json=body, headers=headers, timeout=self.timeout) as resp:
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > self.max_bytes:
                    raise too_large
                chunks.append(chunk)
            return resp.status_code, b"".join(chunks)


# ---------------------------------------------------------------------- the judge


class JudgeScorer:
    """The judge model, shown the conversation up to the call and the K candidates side by side."""

    name = "judge"

    def __init__(self, judge: Judge) -> None:
        self.judge = judge
        self._failed: dict[str, None] = {}  # groups whose last call failed: asked again hotter

    async def score(self, req: ScoreRequest) -> list[float]:
        s = self.judge.settings
        chat = chat_form(req.request)
        conversation = chat.get("messages") if isinstance(chat.get("messages"), list) else []
        if not conversation and isinstance(chat.get("prompt"), str):
            conversation = [{"role": "prompt", "content": chat["prompt"]}]
        rubric = s.judge_rubrics.get(req.policy) or s.judge_rubric or DEFAULT_TURN_RUBRIC
        messages = build_turn_messages(
            conversation, req.candidates, rubric, s.judge_max_chars, chat.get("tools")
        )
        retry = req.group_id in self._failed  # a greedy judge would repeat the same malformed answer
        temperature = max(s.judge_temperature, RETRY_TEMPERATURE) if retry else s.judge_temperature
        try:
            scores = await self.judge.ask(messages, len(req.candidates), temperature)
        except (JudgeOutputError, JudgeUnavailable) as exc:
            self._failed[req.group_id] = None
            while len(self._failed) > 1024:
                del self._failed[next(iter(self._failed))]
            raise ScorerError(f"judge: {_one_line(str(exc))}") from exc
        self._failed.pop(req.group_id, None)
        return [s for s, _ in scores]


# ---------------------------------------------------------------------- combining, building


class WithChecks:
    """A primary scorer with the built-in checks as partial credit: (1 - w) * primary + w * checks."""

    def __init__(self, primary: Scorer, weight: float) -> None:
        self.primary, self.weight = primary, weight
        self.name = f"{primary.name}+checks"

    async def score(self, req: ScoreRequest) -> list[float]:
        w = self.weight
        primary = await self.primary.score(req)
        return [(1 - w) * p + w * c for p, c in zip(primary, check_scores(req), strict=True)]


def build_scorer(settings: Settings, client: httpx.AsyncClient, judge: Judge | None = None) -> Scorer:
    """The scorer `settings.scorer` names (with the checks mixed in when `scorer_checks_weight` > 0).

    `client` carries the url scorer's calls; `judge` is the judge to ask (compose's, so its endpoint
    defaults to the upstream and its calls are counted in /metrics), else one built from the judge
    settings (`judge_base_url` and `judge_model` then needed). ConfigError for scorer=url without
    `scorer_url`."""
    primary: Scorer
    if settings.scorer == "checks":
        return ChecksScorer()
    if settings.scorer == "url":
        url = settings.scorer_url
        if not url:
            raise ConfigError(
                "scorer=url needs scorer_url: set RLPROXY_SCORER_URL to the app's scorer endpoint"
            )
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"scorer_url {url!r} is not an http:// or https:// URL")
        primary = UrlScorer(
            client, url, settings.scorer_api_key, settings.scorer_timeout, settings.scorer_max_bytes
        )
    else:
        if judge is None and not (settings.judge_base_url and settings.judge_model):
            raise ConfigError(
                "scorer=judge needs a judge: set RLPROXY_JUDGE_BASE_URL and RLPROXY_JUDGE_MODEL "
                "(the proxy passes its own judge, whose default is the upstream)"
            )
        primary = JudgeScorer(judge or Judge(settings.group(JudgeSettings)))
    w = settings.scorer_checks_weight
    return WithChecks(primary, w) if w > 0 else primary
