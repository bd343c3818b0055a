"""rlproxy.client against a real proxy (uvicorn on a loopback port, stub upstream, real SQLite)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from proxy.proxy_helpers import ProxyServer

import rlproxy.client
from rlproxy.client import RewardError

KEY = "sk-agents-key"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def serve(loop_thread: Any, stub: Any, tmp_path: Path) -> Iterator[Callable[..., ProxyServer]]:
    """serve(**settings) -> a started proxy in front of the stub, on a database of its own."""
    from rlproxy.compose import build_app
    from rlproxy.inference.vllm import VLLMBackend
    from rlproxy.settings import Settings

    started: list[ProxyServer] = []

    def make(**overrides: Any) -> ProxyServer:
        db = tmp_path / f"client{len(started)}.db"
        settings = Settings(db_url=f"sqlite+aiosqlite:///{db}", train=False, model="stub-model", **overrides)
        backend = VLLMBackend("stub-model", upstream=stub.url)
        started.append(ProxyServer(loop_thread, build_app(settings, backend), db).start())
        return started[-1]

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def proxy(request: pytest.FixtureRequest, serve: Callable[..., ProxyServer]) -> ProxyServer:
    """A proxy with the agents' key set when the test is parametrized with `key`."""
    return serve(api_key=getattr(request, "param", None))


@pytest.mark.parametrize("proxy", [None, KEY], ids=["open", "key"], indirect=True)
def test_run_sets_headers_and_posts_the_reward(proxy: ProxyServer) -> None:
    key = KEY if proxy.state.settings.api_key else None
    with rlproxy.client.run(base_url=f"{proxy.url}/v1", api_key=key, group_id="task-7", max_retries=0) as run:
        assert run.id.startswith("run-")
        run.openai.chat.completions.create(model="stub-model", messages=MESSAGES)
        run.openai.chat.completions.create(model="stub-model", messages=MESSAGES)
        answer = run.reward(0.75, metrics={"turns": 2}, metadata={"note": "ok"})
    assert answer == {"run_id": run.id, "reward": 0.75, "stored": True}
    assert proxy.query(
        "SELECT id, group_id, reward, metrics ->> '$.turns', metadata ->> '$.note', status FROM runs"
    ) == [(run.id, "task-7", 0.75, 2.0, "ok", "completed")]
    assert proxy.query("SELECT count(*) FROM completions WHERE run_id = ?", run.id) == [(2,)]


@pytest.mark.parametrize("proxy", [KEY], ids=["key"], indirect=True)
def test_reward_errors_raise(proxy: ProxyServer) -> None:
    base = f"{proxy.url}/v1"
    with rlproxy.client.run(base_url=base, api_key=KEY, run_id="ep-1", max_retries=0) as run:
        run.openai.chat.completions.create(model="stub-model", messages=MESSAGES)
        run.reward(1.0)
        assert run.reward(1.0)["stored"] is False  # the same reward again is fine
        with pytest.raises(RewardError) as conflict:
            run.reward(0.0)
        assert conflict.value.status_code == 409 and conflict.value.code == "conflict"
        with pytest.raises(RewardError) as bad:
            run.reward(1.0, metrics={"turns": "two"})  # type: ignore[dict-item]
        assert bad.value.status_code == 422 and "metrics.turns" in bad.value.message
        with pytest.raises(ValueError, match="finite"):
            run.reward(float("nan"))  # refused before it is sent
    with rlproxy.client.run(base_url=base, api_key=KEY) as never_called:
        with pytest.raises(RewardError) as unknown:
            never_called.reward(1.0)
        assert unknown.value.status_code == 404 and "not found" in str(unknown.value)
    with rlproxy.client.run(base_url=base, api_key="wrong", run_id="ep-1") as wrong:
        with pytest.raises(RewardError) as denied:
            wrong.reward(1.0)
        assert denied.value.status_code == 401
    assert proxy.query("SELECT id, reward FROM runs") == [("ep-1", 1.0)]


def test_path_form_base_url_and_environment(proxy: ProxyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path-form OPENAI_BASE_URL names the run; the client reads it (and the key) from the env."""
    monkeypatch.setenv("OPENAI_BASE_URL", f"{proxy.url}/runs/ep-9/v1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with rlproxy.client.run(max_retries=0) as run:
        assert run.id == "ep-9"
        run.openai.chat.completions.create(model="stub-model", messages=MESSAGES)
        assert run.reward(0.25)["run_id"] == "ep-9"
    with pytest.raises(ValueError, match="names run 'ep-9'"):
        with rlproxy.client.run(run_id="other"):
            pass
    assert proxy.query("SELECT id, reward FROM runs") == [("ep-9", 0.25)]


def test_async_run(proxy: ProxyServer) -> None:
    async def episode() -> str:
        async with rlproxy.client.arun(base_url=f"{proxy.url}/v1", run_id="a-1", max_retries=0) as run:
            await run.openai.chat.completions.create(model="stub-model", messages=MESSAGES)
            await run.reward(1.0)
            with pytest.raises(RewardError) as conflict:
                await run.reward(2.0)
            assert conflict.value.status_code == 409
            return run.id

    assert asyncio.run(episode()) == "a-1"
    assert proxy.query("SELECT id, reward FROM runs") == [("a-1", 1.0)]


def test_reward_retries_a_503_while_a_stream_of_the_run_runs(serve: Callable[..., ProxyServer]) -> None:
    """The proxy answers 503 + Retry-After while a stream of the run is still running; the helper
    waits as told and posts again, so the reward lands once the stream has ended."""
    proxy = serve(store_wait_timeout=0.3)  # a reward while a stream of its run runs: 503 after 0.3 s
    with rlproxy.client.run(base_url=f"{proxy.url}/v1", run_id="s-1", max_retries=0) as run:
        stream = run.openai.chat.completions.create(
            model="stub-model", messages=MESSAGES, stream=True, extra_headers={"x-stub-delay": "1.0"}
        )
        done = threading.Thread(target=lambda: list(stream))
        done.start()
        started = time.monotonic()
        assert run.reward(1.0) == {"run_id": "s-1", "reward": 1.0, "stored": True}
        assert time.monotonic() - started >= 0.3  # it was refused at least once
        done.join(10)
    assert proxy.query("SELECT status, stream FROM completions") == [("ok", 1)]


def test_a_503_whose_commit_had_begun_is_still_this_calls_reward(serve: Callable[..., ProxyServer]) -> None:
    """A reward the store began to commit but could not finish within `store_wait_timeout` is a 503,
    yet it lands (here a trigger makes the commit of a run's first reward take ~1 s of CPU); the
    helper's retry then finds the same reward stored, and its answer says `stored: true`, since this
    call stored it (CI saw `stored: false` on a loaded box, the store taking over 0.3 s to commit)."""
    proxy = serve(store_wait_timeout=0.3)
    db = sqlite3.connect(proxy.db_path, isolation_level=None)
    db.execute("CREATE TABLE pad (i INTEGER)")
    db.executemany("INSERT INTO pad VALUES (?)", [(i,) for i in range(3200)])
    db.execute(
        "CREATE TRIGGER slow_first_reward AFTER UPDATE OF reward ON runs WHEN OLD.reward IS NULL "
        "BEGIN SELECT max(a.i * b.i % 7) FROM pad a, pad b; END"
    )
    db.close()
    with rlproxy.client.run(base_url=f"{proxy.url}/v1", run_id="l-1", max_retries=0) as run:
        run.openai.chat.completions.create(model="stub-model", messages=MESSAGES)
        started = time.monotonic()
        assert run.reward(0.5) == {"run_id": "l-1", "reward": 0.5, "stored": True}
        assert time.monotonic() - started >= 1.0  # refused once, then posted again after Retry-After
        assert run.reward(0.5)["stored"] is False  # a second call of its own is a repeat, as before
    assert proxy.query("SELECT id, reward, status FROM runs") == [("l-1", 0.5, "completed")]


def test_kwargs_pass_through_and_default_headers_merge(proxy: ProxyServer) -> None:
    """Issue 26: `run(default_headers=...)` was a TypeError (passed twice to openai.OpenAI)."""
    with rlproxy.client.run(
        base_url=f"{proxy.url}/v1", default_headers={"X-App": "mine", "X-Run-Id": "not-this"}, timeout=30
    ) as run:
        run.openai.chat.completions.create(model="stub-model", messages=MESSAGES)
        assert run.openai.timeout == 30
        headers = run.openai.default_headers
        assert headers["X-App"] == "mine" and headers["X-Run-Id"] == run.id
    assert proxy.query("SELECT run_id FROM completions") == [(run.id,)]  # the run's own id wins


def test_split_val_makes_a_validation_run(proxy: ProxyServer) -> None:
    with rlproxy.client.run(base_url=f"{proxy.url}/v1", split="val") as run:
        run.openai.chat.completions.create(model="stub-model", messages=MESSAGES)
        run.reward(1.0)
    assert proxy.query("SELECT split, status FROM runs") == [("val", "validated")]
    with pytest.raises(ValueError, match="split"):
        rlproxy.client.run(base_url=f"{proxy.url}/v1", split="test").__enter__()


def test_complete_hands_the_run_to_the_judge(proxy: ProxyServer) -> None:
    with rlproxy.client.run(base_url=f"{proxy.url}/v1") as run:
        run.openai.chat.completions.create(model="stub-model", messages=MESSAGES)
        answer = run.complete(rubric="A short answer scores 1.")
    assert answer["judge"] is True and answer["stored"] is True
    assert proxy.query("SELECT reward_source, judge_rubric, status FROM runs") == [
        ("judge", "A short answer scores 1.", "completed")
    ]
