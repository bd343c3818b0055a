"""Scorers (trainer/scorers.py): the built-in checks with exact numbers, the app's url scorer against a
real uvicorn server on a loopback port (what it is sent, and every way its answer can be wrong), the
judge scorer against a stub judge model server, the checks mixed in, and `build_scorer`."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from support import free_port

from rlproxy.errors import ConfigError
from rlproxy.settings import JudgeSettings, Settings
from rlproxy.trainer.judge import Judge
from rlproxy.trainer.judge_prompt import DEFAULT_TURN_RUBRIC
from rlproxy.trainer.resample import as_message
from rlproxy.trainer.scorers import (
    ChecksScorer,
    JudgeScorer,
    ScoreRequest,
    ScorerError,
    UrlScorer,
    build_scorer,
    check_scores,
)

READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
            "required": ["path"],
        },
    },
}
LIST_DIR = {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object"}}}
MESSAGES = [
    {"role": "system", "content": "You are a file agent."},
    {"role": "user", "content": "Show me notes.txt"},
]


def call(name: str, args: Any) -> str:
    """A hermes tool call as the model writes it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def req(request: dict[str, Any], candidates: list[dict[str, Any]], **kw: Any) -> ScoreRequest:
    return ScoreRequest("g1", "agent", kw.pop("endpoint", "chat.completions"), request, candidates, **kw)


# ---------------------------------------------------------------------- checks


def test_checks_without_tools_or_format_only_look_at_the_cut() -> None:
    r = req(
        {"messages": MESSAGES}, [as_message("hi", "stop"), as_message("hi", "length"), as_message("x", None)]
    )
    assert check_scores(r) == [1.0, 0.0, 1.0]


def test_tool_checks_exact() -> None:
    cands = [
        as_message(call("read_file", {"path": "notes.txt"}), "stop"),  # right: 2/2
        as_message('<tool_call>{"name": "read_file", "arguments": ', "stop"),  # unparsed markup: 1/2
        as_message(call("delete_file", {"path": "notes.txt"}), "stop"),  # not offered: 1/2
        as_message(call("read_file", {"lines": 3}), "stop"),  # misses the required path: 1/2
        as_message(call("read_file", {"path": "a", "lines": "3"}), "stop"),  # lines not an integer: 1/2
        as_message('<tool_call>{"name": "read_file", "arguments": "[1]"}</tool_call>', "stop"),  # no object
        as_message("Here it is.", "stop"),  # no call, not required: only the cut applies: 1/1
        as_message(call("read_file", {"path": "notes.txt"}), "length"),  # right but cut: 1/2
        as_message('<tool_call>{"name": "read_', "length"),  # unparsed and cut: 0/2
        as_message(call("list_dir", {}) + call("read_file", {"path": "x"}), "stop"),  # two right calls
        as_message(call("list_dir", {}) + call("read_file", {}), "stop"),  # one of two wrong: 1/2
    ]
    r = req({"messages": MESSAGES, "tools": [READ_FILE, LIST_DIR]}, cands)
    assert check_scores(r) == [1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 0.5, 0.0, 1.0, 0.5]


def test_tool_choice_required_named_and_none() -> None:
    cands = [
        as_message("Here it is.", "stop"),
        as_message(call("read_file", {"path": "a"}), "stop"),
        as_message(call("list_dir", {}), "stop"),
    ]
    tools = [READ_FILE, LIST_DIR]
    assert check_scores(req({"messages": MESSAGES, "tools": tools, "tool_choice": "required"}, cands)) == [
        0.5,
        1.0,
        1.0,
    ]
    named = {"type": "function", "function": {"name": "read_file"}}
    assert check_scores(req({"messages": MESSAGES, "tools": tools, "tool_choice": named}, cands)) == [
        0.5,
        1.0,
        0.5,
    ]
    assert check_scores(req({"messages": MESSAGES, "tools": tools, "tool_choice": "none"}, cands)) == [
        1.0,
        0.5,
        0.5,
    ]


def test_a_remote_schema_ref_is_never_fetched() -> None:
    """An app's tool schema is data: its `$ref` to a URL is not resolved (jsonschema's default would
    fetch it, blocking, from wherever it points); the schema then checks nothing."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            hits.append(self.path)
            body = b'{"type": "string"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ref = f"http://127.0.0.1:{server.server_address[1]}/schema.json"
        tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": ref}}}
        r = req({"messages": MESSAGES, "tools": [tool]}, [as_message(call("f", {"a": 1}), "stop")])
        assert check_scores(r) == [1.0]
        assert hits == []
    finally:
        server.shutdown()
        server.server_close()


def test_json_checks_exact() -> None:
    cands = [
        as_message('{"n": 1}', "stop"),
        as_message("not json", "stop"),
        as_message("[1, 2]", "stop"),
        as_message('{"n": "one"}', "stop"),
        as_message('{"n": 1}', "length"),
        as_message("", "stop"),
    ]
    obj = req({"messages": MESSAGES, "response_format": {"type": "json_object"}}, cands)
    assert check_scores(obj) == [1.0, 0.5, 0.5, 1.0, 0.5, 0.5]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert check_scores(req({"messages": MESSAGES, "response_format": fmt}, cands)) == [
        1.0,
        0.5,
        0.5,
        0.5,
        0.5,
        0.5,
    ]
    assert check_scores(req({"messages": MESSAGES, "response_format": {"type": "text"}}, cands)) == [
        1.0,
        1.0,
        1.0,
        1.0,
        0.0,
        1.0,
    ]


def test_three_checks_at_once() -> None:
    body = {
        "messages": MESSAGES,
        "tools": [READ_FILE],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    cands = [
        as_message('{"a": 1}', "stop"),  # no call though required, JSON right, not cut: 2/3
        as_message(call("read_file", {"path": "a"}), "stop"),  # a call: the JSON check does not apply: 2/2
        as_message("nope", "length"),  # 0/3
    ]
    assert check_scores(req(body, cands)) == [2 / 3, 1.0, 0.0]


def test_checks_read_responses_and_messages_bodies() -> None:
    params = READ_FILE["function"]["parameters"]
    cands = [as_message(call("read_file", {"path": "a"}), "stop"), as_message(call("read_file", {}), "stop")]
    responses = {
        "model": "agent",
        "instructions": "You are a file agent.",
        "input": "Show me notes.txt",
        "tools": [{"type": "function", "name": "read_file", "parameters": params}],
    }
    assert check_scores(req(responses, cands, endpoint="responses")) == [1.0, 0.5]
    anthropic = {
        "model": "agent",
        "max_tokens": 64,
        "system": "You are a file agent.",
        "messages": [{"role": "user", "content": "Show me notes.txt"}],
        "tools": [{"name": "read_file", "input_schema": params}],
    }
    assert check_scores(req(anthropic, cands, endpoint="messages")) == [1.0, 0.5]


# ---------------------------------------------------------------------- a real scorer server


class ScorerServer:
    """The app's scorer on a loopback port: `answer(body)` makes each response; it records what it got."""

    def __init__(self, answer: Callable[[dict[str, Any]], Any]) -> None:
        self.answer = answer
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.paths: list[str] = []
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/score"

    async def _score(self, request: Request) -> Response:
        self.bodies.append(await request.json())
        self.auth.append(request.headers.get("authorization"))
        self.paths.append(request.url.path)
        out = self.answer(self.bodies[-1])
        return await out if asyncio.iscoroutine(out) else out

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[ScorerServer]:
        routes = [Route(p, self._score, methods=["POST"]) for p in ("/score", "/tenant-b")]
        server = uvicorn.Server(
            uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=self.port, log_level="warning")
        )
        task = asyncio.create_task(server.serve())
        for _ in range(300):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started
        try:
            yield self
        finally:
            server.should_exit = True
            await task


def settings(**kw: Any) -> Settings:
    values: dict[str, Any] = {"scorer": "url", "scorer_api_key": "sk-scorer", "scorer_timeout": 5.0, **kw}
    return Settings(**values)


@asynccontextmanager
async def url_scorer(
    answer: Callable[[dict[str, Any]], Any], **kw: Any
) -> AsyncIterator[tuple[Any, ScorerServer]]:
    server = ScorerServer(answer)
    async with server.serving(), httpx.AsyncClient() as client:
        yield build_scorer(settings(scorer_url=server.url, **kw), client), server


TOOL_REQUEST = {
    "model": "agent",
    "messages": MESSAGES,
    "tools": [READ_FILE],
    "response_format": {"type": "json_object"},
    "max_tokens": 32,
    "temperature": 0.7,
}
CANDS = [
    as_message(call("read_file", {"path": "notes.txt"}), "tool_calls"),
    as_message("I cannot.", "stop"),
    as_message("<tool_call>{", "length"),
]


async def test_url_scorer_sends_the_spec_body_with_the_key() -> None:
    async with url_scorer(lambda b: JSONResponse({"scores": [1, 0.25, -2.5]})) as (scorer, server):
        assert scorer.name == "url"
        assert await scorer.score(req(TOOL_REQUEST, CANDS)) == [1.0, 0.25, -2.5]
    assert server.auth == ["Bearer sk-scorer"]
    assert server.bodies == [
        {
            "group_id": "g1",
            "policy": "agent",
            "endpoint": "chat.completions",
            "messages": MESSAGES,
            "tools": [READ_FILE],
            "response_format": {"type": "json_object"},
            "max_tokens": 32,
            "candidates": [
                {
                    "index": 0,
                    "content": None,
                    "tool_calls": CANDS[0]["tool_calls"],
                    "finish_reason": "tool_calls",
                },
                {"index": 1, "content": "I cannot.", "tool_calls": None, "finish_reason": "stop"},
                {"index": 2, "content": "<tool_call>{", "tool_calls": None, "finish_reason": "length"},
            ],
        }
    ]
    assert server.bodies[0]["candidates"][0]["tool_calls"][0]["function"] == {
        "name": "read_file",
        "arguments": '{"path": "notes.txt"}',
    }


async def test_url_scorer_sends_a_responses_call_as_chat_messages_and_a_keys_own_url() -> None:
    body = {"model": "agent", "instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}]}
    async with url_scorer(lambda b: JSONResponse({"scores": [0.5, 0.5]})) as (scorer, server):
        own = server.url.replace("/score", "/tenant-b")
        cands = [as_message("a", "stop"), as_message("b", "stop")]
        assert await scorer.score(req(body, cands, endpoint="responses", scorer_url=own)) == [0.5, 0.5]
    assert server.paths == ["/tenant-b"]
    sent = server.bodies[0]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (sent["tools"], sent["response_format"], sent["max_tokens"]) == (None, None, None)
    assert "input" not in sent and "instructions" not in sent


async def test_url_scorer_sends_a_messages_call_as_chat_messages() -> None:
    body = {
        "model": "agent",
        "max_tokens": 64,
        "system": "You are a file agent.",
        "messages": [
            {"role": "user", "content": "Show me notes.txt"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "notes.txt"}}
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "hello"}]},
        ],
        "tools": [{"name": "read_file", "input_schema": READ_FILE["function"]["parameters"]}],
    }
    async with url_scorer(lambda b: JSONResponse({"scores": [0.5]})) as (scorer, server):
        await scorer.score(req(body, [as_message("It says hello.", "stop")], endpoint="messages"))
    sent = server.bodies[0]
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "tool"]
    assert sent["messages"][2]["tool_calls"][0]["function"] == {
        "name": "read_file",
        "arguments": '{"path": "notes.txt"}',
    }
    assert sent["messages"][3]["content"] == "hello"
    assert sent["tools"][0]["function"]["name"] == "read_file" and sent["max_tokens"] == 64


async def test_url_scorer_without_a_key_sends_no_authorization() -> None:
    async with url_scorer(lambda b: JSONResponse({"scores": [1]}), scorer_api_key=None) as (scorer, server):
        await scorer.score(req({"messages": MESSAGES}, [as_message("a", "stop")]))
    assert server.auth == [None]


def text(body: str, status: int = 200) -> Callable[[dict[str, Any]], Response]:
    return lambda b: Response(body, status_code=status, media_type="application/json")


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (text('{"error": "boom"}\nline two', 500), 'scorer answered HTTP 500: {"error": "boom"} line two'),
        (text("<html>ok</html>"), "scorer answer is not JSON"),
        (text('{"scores": [1, 2]}'), "scorer answered 2 scores for 3 candidates"),
        (text('{"scores": [1, 2, 3, 4]}'), "scorer answered 4 scores for 3 candidates"),
        (text('{"scores": [1, NaN, 2]}'), "scorer score 1 is nan, not a finite number"),
        (text('{"scores": [Infinity, 1, 2]}'), "scorer score 0 is inf, not a finite number"),
        (text('{"scores": [1, 2, -Infinity]}'), "scorer score 2 is -inf, not a finite number"),
        (text('{"scores": [1, "2", 3]}'), "scorer score 1 is '2', not a finite number"),
        (text('{"scores": [true, 0, 1]}'), "scorer score 0 is True, not a finite number"),
        (text('{"scores": [1, null, 1]}'), "scorer score 1 is None, not a finite number"),
        (text("[1, 2, 3]"), 'scorer answer is not an object with a "scores" list'),
        (text('{"score": [1, 2, 3]}'), 'scorer answer is not an object with a "scores" list'),
    ],
)
async def test_url_scorer_refuses_a_bad_answer(answer: Callable[..., Response], reason: str) -> None:
    async with url_scorer(answer) as (scorer, _):
        with pytest.raises(ScorerError) as err:
            await scorer.score(req(TOOL_REQUEST, CANDS))
    assert str(err.value).startswith(reason)
    assert "\n" not in str(err.value)


async def test_url_scorer_times_out() -> None:
    async def slow(body: dict[str, Any]) -> Response:
        await asyncio.sleep(2)
        return JSONResponse({"scores": [1, 1, 1]})

    async with url_scorer(slow, scorer_timeout=0.3) as (scorer, _):
        t0 = time.monotonic()
        with pytest.raises(ScorerError, match=r"did not answer within scorer_timeout \(0.3 s\)"):
            await scorer.score(req(TOOL_REQUEST, CANDS))
        assert time.monotonic() - t0 < 1.8


async def test_url_scorer_times_out_on_a_trickled_answer() -> None:
    """Each byte comes before httpx's read timeout, the whole answer never does."""

    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"scores": [1, 1, 1]'
        for _ in range(100):
            await asyncio.sleep(0.1)
            yield b" "

    answer = lambda b: StreamingResponse(trickle(), media_type="application/json")  # noqa: E731
    async with url_scorer(answer, scorer_timeout=0.5) as (scorer, _):
        t0 = time.monotonic()
        with pytest.raises(ScorerError, match="did not answer within scorer_timeout"):
            await scorer.score(req(TOOL_REQUEST, CANDS))
        assert time.monotonic() - t0 < 3


async def test_url_scorer_refuses_an_answer_over_max_bytes() -> None:
    """A valid answer padded past the bound (declared length), and an endless stream (no length)."""
    padded = '{"scores": [1, 2, 3]}' + " " * 1100
    async with url_scorer(text(padded), scorer_max_bytes=1024) as (scorer, _):
        with pytest.raises(ScorerError, match=r"larger than scorer_max_bytes \(1024\)"):
            await scorer.score(req(TOOL_REQUEST, CANDS))
    async with url_scorer(text(padded), scorer_max_bytes=2048) as (scorer, _):  # the same under the bound
        assert await scorer.score(req(TOOL_REQUEST, CANDS)) == [1.0, 2.0, 3.0]

    async def endless() -> AsyncIterator[bytes]:
        yield b'{"scores": [1, 2, 3]'
        while True:
            yield b" " * 512
            await asyncio.sleep(0)

    answer = lambda b: StreamingResponse(endless(), media_type="application/json")  # noqa: E731
    async with url_scorer(answer, scorer_max_bytes=4096, scorer_timeout=10) as (scorer, _):
        t0 = time.monotonic()
        with pytest.raises(ScorerError, match="larger than scorer_max_bytes"):
            await scorer.score(req(TOOL_REQUEST, CANDS))
        assert time.monotonic() - t0 < 5


async def test_url_scorer_unreachable() -> None:
    async with httpx.AsyncClient() as client:
        scorer = UrlScorer(client, f"http://127.0.0.1:{free_port()}/score", None, 5.0, 1024)
        with pytest.raises(ScorerError, match="scorer call failed: ConnectError"):
            await scorer.score(req(TOOL_REQUEST, CANDS))


async def test_checks_mixed_into_the_url_scores() -> None:
    cands = [as_message("a", "length"), as_message("b", "stop")]  # checks: [0, 1]
    answer = lambda b: JSONResponse({"scores": [1.0, 0.0]})  # noqa: E731
    async with url_scorer(answer, scorer_checks_weight=0.25) as (scorer, _):
        assert scorer.name == "url+checks"
        assert await scorer.score(req({"messages": MESSAGES}, cands)) == [0.75, 0.25]


# ---------------------------------------------------------------------- the judge


class StubJudge:
    """An OpenAI-compatible judge model answering the queued texts in order (the last one forever)."""

    def __init__(self, answers: list[str], status: int = 200) -> None:
        self.answers, self.status = answers, status
        self.requests: list[dict[str, Any]] = []
        self.port = free_port()

    async def _chat(self, request: Request) -> JSONResponse:
        self.requests.append(await request.json())
        if self.status != 200:
            return JSONResponse({"error": {"message": "down"}}, status_code=self.status)
        content = self.answers[min(len(self.requests), len(self.answers)) - 1]
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        return JSONResponse({"id": "j", "object": "chat.completion", "choices": [choice], "usage": {}})

    @asynccontextmanager
    async def scorer(self, **kw: Any) -> AsyncIterator[Any]:
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        for _ in range(300):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        base = f"http://127.0.0.1:{self.port}/v1"
        try:
            async with httpx.AsyncClient() as client:
                s = Settings(scorer="judge", judge_base_url=base, judge_model="judge-m", **kw)
                scorer = build_scorer(s, client)
                yield scorer
                await getattr(scorer, "primary", scorer).judge.close()
        finally:
            server.should_exit = True
            await task


JUDGE_CANDS = [as_message(call("read_file", {"path": "notes.txt"}), "tool_calls"), as_message("No.", "stop")]


async def test_judge_scorer_sees_the_turn_and_the_candidates_side_by_side() -> None:
    stub = StubJudge(['```json\n{"scores": [{"id": "1", "score": 0.9}, {"id": "2", "score": 0.2}]}\n```'])
    async with stub.scorer() as scorer:
        assert isinstance(scorer, JudgeScorer) and scorer.name == "judge"
        assert await scorer.score(req({"messages": MESSAGES, "tools": [READ_FILE]}, JUDGE_CANDS)) == [
            0.9,
            0.2,
        ]
        assert scorer.judge.stats.calls["ok"] == 1
    (sent,) = stub.requests
    assert sent["model"] == "judge-m" and sent["response_format"] == {"type": "json_object"}
    system, user = sent["messages"][0]["content"], sent["messages"][1]["content"]
    assert DEFAULT_TURN_RUBRIC in system and "2 candidates" in system
    assert "Show me notes.txt" in user and "read_file" in user and '"No."' in user
    assert user.count("<candidate-") == 2 and user.count("<conversation-") == 1
    assert user.index("Show me notes.txt") < user.index('id="1"') < user.index('"No."')


async def test_judge_scorer_uses_the_policys_rubric_and_mixes_checks() -> None:
    stub = StubJudge(['{"scores": [{"id": "1", "score": 1}, {"id": "2", "score": 0.5}]}'])
    async with stub.scorer(
        judge_rubrics={"agent": "Prefer reading the file."}, scorer_checks_weight=0.5
    ) as s:
        assert s.name == "judge+checks"
        cands = [as_message("a", "length"), as_message("b", "stop")]  # checks [0, 1]
        assert await s.score(req({"messages": MESSAGES}, cands)) == [0.5, 0.75]
    system = stub.requests[0]["messages"][0]["content"]
    assert "Prefer reading the file." in system and DEFAULT_TURN_RUBRIC not in system


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("The second one is better.", "no JSON object"),
        ('{"scores": [{"id": "1", "score": 0.9}]}', "scored 1 of 2"),
        ('{"scores": [{"id": "1", "score": 1.5}, {"id": "2", "score": 0}]}', "outside [0, 1]"),
        ('{"scores": [{"id": "1", "score": NaN}, {"id": "2", "score": 0}]}', "not a finite number"),
    ],
)
async def test_judge_scorer_refuses_malformed_output_and_asks_again_hotter(answer: str, reason: str) -> None:
    stub = StubJudge([answer, '{"scores": [0.1, 0.3]}'])
    async with stub.scorer() as scorer:
        with pytest.raises(ScorerError, match=re.escape(reason)) as err:
            await scorer.score(req({"messages": MESSAGES}, JUDGE_CANDS))
        assert str(err.value).startswith("judge: ") and "\n" not in str(err.value)
        assert scorer.judge.stats.calls["malformed"] == 1
        assert await scorer.score(req({"messages": MESSAGES}, JUDGE_CANDS)) == [0.1, 0.3]
    assert [r["temperature"] for r in stub.requests] == [0.0, 0.7]


async def test_judge_scorer_down_is_a_scorer_error() -> None:
    async with StubJudge([], status=503).scorer() as scorer:
        with pytest.raises(ScorerError, match="judge: HTTP 503"):
            await scorer.score(req({"messages": MESSAGES}, JUDGE_CANDS))


# ---------------------------------------------------------------------- build_scorer


async def test_build_scorer() -> None:
    async with httpx.AsyncClient() as client:
        assert isinstance(build_scorer(Settings(), client), ChecksScorer)
        assert build_scorer(Settings(scorer_checks_weight=0.5), client).name == "checks"
        with pytest.raises(ConfigError, match="scorer=url needs scorer_url: set RLPROXY_SCORER_URL"):
            build_scorer(Settings(scorer="url"), client)
        with pytest.raises(ConfigError, match="not an http"):
            build_scorer(Settings(scorer="url", scorer_url="file:///etc/passwd"), client)
        with pytest.raises(ConfigError, match="scorer=judge needs a judge"):
            build_scorer(Settings(scorer="judge"), client)
        judge = Judge(JudgeSettings(judge_base_url="http://127.0.0.1:1/v1", judge_model="m"))
        scorer = build_scorer(Settings(scorer="judge"), client, judge=judge)
        assert isinstance(scorer, JudgeScorer) and scorer.judge is judge
