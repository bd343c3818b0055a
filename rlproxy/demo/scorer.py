"""The demo's url scorer: a task's own call-level checker served over HTTP (`rlproxy demo --signal scorer`).

This is what an app with a verifier runs beside its agent: `serve` is started with
`--scorer url --scorer-url <this>/score`, and for every sibling group it posts the wire format of
docs/siblings.md:

    POST /score  {"group_id", "policy", "endpoint", "messages": [...], "tools": [...] | null,
                  "response_format": ... | null, "max_tokens": N | null,
                  "candidates": [{"index", "content", "tool_calls", "finish_reason"}, ...]}
    200 {"scores": [K numbers]}         (demo/checkers.py gives each candidate its number)

A body that is not that shape is a 400 in OpenAI's error shape; with `api_key` set, a request
without `Authorization: Bearer <api_key>` is a 401. `calls`, `candidates` and `errors` count what it
was asked (the demo's summary reports them).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rlproxy.demo.checkers import CHECKERS, score_body
from rlproxy.demo.provider import ProviderServer

log = logging.getLogger(__name__)


def _error(status: int, message: str, code: str) -> Response:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return JSONResponse({"error": error}, status_code=status)


def _shape_error(body: Any) -> str | None:
    """What is wrong with a request body, or None when it is the wire format."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    if not isinstance(body.get("messages"), list):
        return "messages: a list is required"
    candidates = body.get("candidates")
    if not isinstance(candidates, list) or not candidates:
        return "candidates: a non-empty list is required"
    for i, c in enumerate(candidates):
        if not isinstance(c, dict):
            return f"candidates[{i}]: an object is required"
        if c.get("content") is not None and not isinstance(c["content"], str):
            return f"candidates[{i}].content: a string or null is required"
        if c.get("tool_calls") is not None and not isinstance(c["tool_calls"], list):
            return f"candidates[{i}].tool_calls: a list or null is required"
    return None


class TaskScorer:
    """The Starlette app that scores candidates with one demo task's checker."""

    def __init__(self, task: str, api_key: str | None = None) -> None:
        if task not in CHECKERS:
            raise ValueError(f"no checker for task {task!r}: choose one of {', '.join(CHECKERS)}")
        self.task, self.api_key = task, api_key
        self.calls = self.candidates = self.errors = 0
        self.app = Starlette(routes=[Route("/score", self._score, methods=["POST"])])

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "candidates": self.candidates, "errors": self.errors}

    async def _score(self, request: Request) -> Response:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            self.errors += 1
            return _error(401, "a bearer key is required", "invalid_api_key")
        try:
            body = json.loads(await request.body())
        except ValueError:
            self.errors += 1
            return _error(400, "the body is not JSON", "invalid_json")
        problem = _shape_error(body)
        if problem is not None:
            self.errors += 1
            return _error(400, problem, "invalid_value")
        scores = score_body(self.task, body)
        self.calls += 1
        self.candidates += len(scores)
        log.debug("scored group %s: %s", body.get("group_id"), scores)
        return JSONResponse({"scores": scores})


class ScorerServer(ProviderServer):
    """A task's scorer under uvicorn on a loopback port: `start()`, `.score_url`, `.scorer`, `stop()`."""

    def __init__(self, task: str, api_key: str | None = None) -> None:
        self.scorer = TaskScorer(task, api_key)
        super().__init__(self.scorer)

    @property
    def score_url(self) -> str:
        return f"{self.root}/score"
