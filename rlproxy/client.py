"""An optional helper for new Python code: one episode = one run, its OpenAI client and its reward.

    import rlproxy.client

    with rlproxy.client.run(base_url="http://127.0.0.1:8000/v1", api_key=None) as run:
        reply = run.openai.chat.completions.create(model="smollm2-135m", messages=[...])
        run.reward(0.8, metrics={"turns": 2})

`run.openai` is an ordinary `openai.OpenAI` client whose every request carries `X-Run-Id` (and
`X-Group-Id` with `group_id=`, `X-Split: val` with `split="val"`: a validation run, never trained);
other keyword arguments go to `openai.OpenAI` as they are (`default_headers` are merged with the
run's). `run.reward(...)` posts `POST {base_url}/runs/{id}/reward` with the same key and raises
`RewardError` on any 4xx/5xx (404 unknown run, 409 a different reward, 422 a bad value), after
retrying a 503 (a stream of the run still running, a busy store) a few times as its `Retry-After`
says (a 503 whose commit had already begun lands anyway: a retry then finds the same reward, and the
answer still says `"stored": true`, since this call stored it); `run.complete(rubric=...)` ends
the run without a number for the judge (`/complete`).
`arun(...)` is the same with `openai.AsyncOpenAI` and `await run.reward(...)`.

The proxy stays the zero-code path: this module only saves typing the header and checking the
reward's status. It depends on `openai` and `httpx` alone, never on the rest of rlproxy.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import httpx
import openai

__all__ = ["AsyncRun", "RewardError", "Run", "arun", "run"]

_PATH_RUN = re.compile(r"/runs/([A-Za-z0-9._:-]{1,128})/v1/?$")
_RETRIES_503 = 3  # a 503 on a reward is retryable; more than this is a real outage
_MAX_WAIT_S = 10.0  # longest Retry-After honoured between two tries


class RewardError(Exception):
    """The proxy refused a reward: `status_code` (404, 409, 422, 401, 503, ...), its error `code`
    (`not_found`, `conflict`, `invalid_value`, ...) and `message`, as the proxy's OpenAI-shaped error said."""

    def __init__(self, status_code: int, message: str, code: str | None, body: Any) -> None:
        super().__init__(f"reward refused ({status_code}{', ' + code if code else ''}): {message}")
        self.status_code = status_code
        self.message = message
        self.code = code
        self.body = body


def _settings(base_url: str | None, api_key: str | None, run_id: str | None) -> tuple[str, str | None, str]:
    """(base URL without a trailing slash, key, run id): the arguments, else OPENAI_BASE_URL /
    OPENAI_API_KEY, else a new `run-<hex>` id (or the one a path-form base URL names)."""
    base = (base_url or os.environ.get("OPENAI_BASE_URL") or "").rstrip("/")
    if not base:
        raise ValueError(
            "rlproxy.client.run: pass base_url= or set OPENAI_BASE_URL (e.g. http://127.0.0.1:8000/v1)"
        )
    key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
    in_path = _PATH_RUN.search(base)
    if in_path and run_id is not None and run_id != in_path.group(1):
        raise ValueError(f"base_url names run {in_path.group(1)!r} but run_id is {run_id!r}")
    return base, key, run_id or (in_path.group(1) if in_path else f"run-{uuid.uuid4().hex}")


def _body(value: float, metrics: dict[str, float] | None, metadata: dict[str, Any] | None) -> dict:
    if not math.isfinite(value):
        raise ValueError(f"reward must be a finite number, not {value!r}")
    body: dict[str, Any] = {"reward": value}
    if metrics is not None:
        body["metrics"] = metrics
    if metadata is not None:
        body["metadata"] = metadata
    return body


def _wait(response: httpx.Response) -> float:
    try:
        return min(_MAX_WAIT_S, max(0.05, float(response.headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


def _settle(response: httpx.Response, retried: bool) -> dict:
    """`_check`'s answer, with `stored` True when an earlier try of this call was a 503 and this one
    finds the same reward stored: the proxy withdraws a reward it could not commit in time unless
    its commit had begun, and then it was this call's reward that went in."""
    answer = _check(response)
    if retried and answer.get("stored") is False:
        answer["stored"] = True
    return answer


def _check(response: httpx.Response) -> dict:
    """The JSON of a 2xx reward answer, else `RewardError` with what the proxy said."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    if response.is_success:
        return body if isinstance(body, dict) else {}
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message, code = str(err.get("message")), err.get("code")
    else:
        message, code = str(body)[:500], None
    raise RewardError(response.status_code, message, str(code) if code is not None else None, body)


def _complete_body(rubric: str | None, metadata: dict[str, Any] | None) -> dict:
    body: dict[str, Any] = {}
    if rubric is not None:
        body["rubric"] = rubric
    if metadata is not None:
        body["metadata"] = metadata
    return body


class _RunBase:
    """What `Run` and `AsyncRun` share: the run's headers and URLs, and their clients (of the
    subclass's `_openai_class` / `_http_class`, sync or async)."""

    _openai_class: type
    _http_class: type

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        run_id: str,
        group_id: str | None,
        split: str | None = None,
        **kw: Any,
    ) -> None:
        if split not in (None, "train", "val"):
            raise ValueError(f'split must be "train" or "val", not {split!r}')
        self.base_url = base_url
        self.id = run_id
        self.group_id = group_id
        self.split = split
        self.headers = {
            "X-Run-Id": run_id,
            **({"X-Group-Id": group_id} if group_id else {}),
            **({"X-Split": split} if split else {}),
        }
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._api_key = api_key or "none"  # the OpenAI SDK wants some key; an open proxy ignores it
        self.reward_url = f"{base_url}/runs/{run_id}/reward"
        self.complete_url = f"{base_url}/runs/{run_id}/complete"
        extra = kw.pop("default_headers", None) or {}
        kw["default_headers"] = {**extra, **self.headers}  # the run's headers win
        self.openai = self._openai_class(base_url=base_url, api_key=self._api_key, **kw)
        self._http = self._http_class(timeout=60.0)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} at {self.base_url}>"


class Run(_RunBase):
    """One episode: `openai` (an `openai.OpenAI` carrying the run's headers), `id`, `reward(...)`."""

    _openai_class = openai.OpenAI
    _http_class = httpx.Client

    def _post(self, url: str, body: dict) -> dict:
        for attempt in range(_RETRIES_503 + 1):
            response = self._http.post(url, json=body, headers=self._auth)
            if response.status_code != 503 or attempt == _RETRIES_503:
                return _settle(response, attempt > 0)
            time.sleep(_wait(response))
        raise AssertionError("unreachable")

    def reward(
        self, value: float, metrics: dict[str, float] | None = None, metadata: dict[str, Any] | None = None
    ) -> dict:
        """Post the run's reward; the proxy's answer (`{"run_id", "reward", "stored"}`), or `RewardError`."""
        return self._post(self.reward_url, _body(value, metrics, metadata))

    def complete(self, rubric: str | None = None, metadata: dict[str, Any] | None = None) -> dict:
        """End the run without a number: the judge scores its group (`{"run_id", "judge": true, ...}`)."""
        return self._post(self.complete_url, _complete_body(rubric, metadata))

    def close(self) -> None:
        self.openai.close()
        self._http.close()


class AsyncRun(_RunBase):
    """`Run` with `openai.AsyncOpenAI` and `await run.reward(...)`."""

    _openai_class = openai.AsyncOpenAI
    _http_class = httpx.AsyncClient

    async def _post(self, url: str, body: dict) -> dict:
        for attempt in range(_RETRIES_503 + 1):
            response = await self._http.post(url, json=body, headers=self._auth)
            if response.status_code != 503 or attempt == _RETRIES_503:
                return _settle(response, attempt > 0)
            await asyncio.sleep(_wait(response))
        raise AssertionError("unreachable")

    async def reward(
        self, value: float, metrics: dict[str, float] | None = None, metadata: dict[str, Any] | None = None
    ) -> dict:
        """Post the run's reward; the proxy's answer (`{"run_id", "reward", "stored"}`), or `RewardError`."""
        return await self._post(self.reward_url, _body(value, metrics, metadata))

    async def complete(self, rubric: str | None = None, metadata: dict[str, Any] | None = None) -> dict:
        """End the run without a number: the judge scores its group."""
        return await self._post(self.complete_url, _complete_body(rubric, metadata))

    async def aclose(self) -> None:
        await self.openai.close()
        await self._http.aclose()


R = TypeVar("R", bound=_RunBase)


def _new(
    cls: type[R], base_url: str | None, api_key: str | None, run_id: str | None, group_id: str | None,
    split: str | None, kw: dict[str, Any],
) -> R:  # fmt: skip
    """A `cls` run with the defaults of `run` filled in (the environment's URL and key, a new id)."""
    base, key, rid = _settings(base_url, api_key, run_id)
    return cls(base, key, rid, group_id, split, **kw)


@contextmanager
def run(
    base_url: str | None = None, api_key: str | None = None, run_id: str | None = None,
    group_id: str | None = None, split: str | None = None, **openai_kwargs: Any,
) -> Iterator[Run]:  # fmt: skip
    """One run: `base_url` is the proxy's `/v1` URL (default `OPENAI_BASE_URL`), `api_key` its agents'
    key (default `OPENAI_API_KEY`), `run_id` a new `run-<hex>` unless given, `split="val"` a
    validation run; `openai_kwargs` go to `openai.OpenAI` (`max_retries=`, `timeout=`,
    `default_headers=` merged with the run's). The clients are closed on exit."""
    r = _new(Run, base_url, api_key, run_id, group_id, split, openai_kwargs)
    try:
        yield r
    finally:
        r.close()


@asynccontextmanager
async def arun(
    base_url: str | None = None, api_key: str | None = None, run_id: str | None = None,
    group_id: str | None = None, split: str | None = None, **openai_kwargs: Any,
) -> AsyncIterator[AsyncRun]:  # fmt: skip
    """`run` for asyncio code: `async with rlproxy.client.arun(...) as run:`."""
    r = _new(AsyncRun, base_url, api_key, run_id, group_id, split, openai_kwargs)
    try:
        yield r
    finally:
        await r.aclose()
