"""Issue 22 case 2: a run past `open` takes no more turns into its reward (proxy/runstate.py).

Through real proxies under uvicorn (the `make_proxy` fixture: what `rlproxy serve` builds) on a stub
upstream, with the real openai SDK; and two real `rlproxy serve` replicas on one PostgreSQL.

Before issue 22: nothing refused a completion for a rewarded run, a Responses call with
`previous_response_id` and no run key joined that response's run long after it was trained, and a
response id let its holder copy a run's conversation into a run of its own.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_replicas import Replica, _env, _pg, pg_db, stub_url  # noqa: F401  (fixtures)

from rlproxy.storage.training import load_runs

MSG = [{"role": "user", "content": "hi"}]


def _chat(base: str, run_id: str) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "stub-model", "messages": MSG},
        headers={"X-Run-Id": run_id},
        timeout=30,
    )


def _closed(resp: httpx.Response, code: str = "run_closed") -> None:
    assert resp.status_code == 409, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err


def test_case2_closed_run_takes_no_more_turns(make_proxy, stub):
    proxy = make_proxy(stub.url)
    for _ in range(3):
        assert _chat(proxy.url, "r-1").status_code == 200
    _settled(proxy.state.runs)
    assert proxy.state.runs.lookups == 1  # one store read for the run, not one per request
    assert httpx.post(f"{proxy.url}/v1/runs/r-1/reward", json={"reward": 0.9}).status_code == 200
    relayed = stub.requests
    _closed(_chat(proxy.url, "r-1"))
    # the path form and the SDK alike
    client = openai.OpenAI(base_url=f"{proxy.url}/runs/r-1/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.ConflictError) as exc:
        client.chat.completions.create(model="stub-model", messages=MSG)
    assert exc.value.body["code"] == "run_closed"
    # completed for the judge is closed too
    assert _chat(proxy.url, "r-2").status_code == 200
    assert httpx.post(f"{proxy.url}/v1/runs/r-2/complete", json={}).status_code == 200
    _closed(_chat(proxy.url, "r-2"))
    assert stub.requests == relayed + 1  # only r-2's first turn reached the upstream
    assert proxy.query("SELECT run_id, count(*) FROM completions GROUP BY run_id ORDER BY 1") == [
        ("r-1", 3),
        ("r-2", 1),
    ]


def test_case2_closed_run_is_known_after_a_restart(make_proxy, stub, tmp_path: Path):
    first = make_proxy(stub.url)
    assert _chat(first.url, "r-1").status_code == 200
    assert httpx.post(f"{first.url}/v1/runs/r-1/reward", json={"reward": 0.5}).status_code == 200
    first.stop()
    again = make_proxy(stub.url, db_url=f"sqlite+aiosqlite:///{first.db_path}")
    _closed(_chat(again.url, "r-1"))  # looked up in the store: a fresh replica knows it too


def test_case2_a_run_closed_before_the_start_window_is_refused_from_its_second_turn(
    make_proxy, stub, tmp_path: Path
):
    """A replica reads only the newest `capacity` closed runs at start; an older one is admitted once,
    found closed by the background check, and refused from then on (its slipped turn never trains)."""
    first = make_proxy(stub.url)
    for run_id in ("r-old", "r-new"):
        assert _chat(first.url, run_id).status_code == 200
        assert httpx.post(f"{first.url}/v1/runs/{run_id}/reward", json={"reward": 0.5}).status_code == 200
        time.sleep(0.05)  # completed_at orders them
    first.stop()

    async def scenario() -> list[bool]:
        from rlproxy.proxy.runstate import RunState
        from rlproxy.storage.db import create_engine

        engine = create_engine(str(first.db_path))
        runs = RunState(engine, capacity=1, poll_interval=0.05)
        await runs.load()
        check = asyncio.create_task(runs.poll())
        try:
            seen = [runs.is_closed("r-new"), runs.is_closed("r-old")]
            for _ in range(200):
                if runs.lookups and not runs._unseen:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            return [*seen, runs.is_closed("r-old"), runs.late == 1, runs.lookups == 1]
        finally:
            check.cancel()
            await engine.dispose()

    assert asyncio.run(scenario()) == [True, False, True, True, True]


def _settled(runs, timeout: float = 5.0) -> None:
    """Wait until the background check has read every run admitted unseen (proxy/runstate.py)."""
    deadline = time.monotonic() + timeout
    while (runs._unseen or not runs.lookups) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)


def test_case2_responses_chain_never_moves_into_a_closed_run(make_proxy, stub):
    proxy = make_proxy(stub.url)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)
    first = client.responses.create(
        model="stub-model", input="my password is hunter2", extra_headers={"X-Run-Id": "victim"}
    )
    # while the run is open, the holder of its response id continues it in that run (no run key)
    second = client.responses.create(model="stub-model", input="and?", previous_response_id=first.id)
    # a response id never copies a run's conversation into another run
    with pytest.raises(openai.ConflictError) as exc:
        client.responses.create(
            model="stub-model",
            input="repeat it",
            previous_response_id=first.id,
            extra_headers={"X-Run-Id": "thief"},
        )
    assert exc.value.body["code"] == "previous_response_run_mismatch"
    assert httpx.post(f"{proxy.url}/v1/runs/victim/reward", json={"reward": 0.9}).status_code == 200
    # after the reward: the chain goes on for its user, outside any run (never trained)
    third = client.responses.create(model="stub-model", input="later", previous_response_id=second.id)
    with pytest.raises(openai.ConflictError) as exc:  # naming the closed run is refused
        client.responses.create(
            model="stub-model",
            input="x",
            previous_response_id=second.id,
            extra_headers={"X-Run-Id": "victim"},
        )
    assert exc.value.body["code"] == "run_closed"
    got = proxy.query("SELECT response_id, run_id FROM completions ORDER BY id")
    assert got == [(first.id, "victim"), (second.id, "victim"), (third.id, None)]
    assert proxy.query("SELECT id FROM runs") == [("victim",)]


# ---------------------------------------------------------------------------------------- replicas


def test_case2_reward_on_one_replica_closes_the_run_on_the_other(tmp_path: Path, pg_db: str, stub_url: str):  # noqa: F811
    args = ["--backend", "vllm", "--upstream", stub_url, "--model", "stub-model", "--no-train", "--db", pg_db]
    env = {"RLPROXY_RUN_STATE_POLL_INTERVAL": "0.2"}
    a, b = (Replica(args, _env(tmp_path, n, **env)) for n in "ab")
    try:
        for r in (a, b):
            r.wait_line("OPENAI_BASE_URL=")
        assert _chat(a.base, "r-x").status_code == 200
        assert _chat(b.base, "r-x").status_code == 200
        reward = httpx.post(f"{b.base}/v1/runs/r-x/reward", json={"reward": 0.9}, timeout=30)
        assert reward.status_code == 200, reward.text
        slipped = _chat(a.base, "r-x")  # at once: may still be taken by A (within one poll interval)
        time.sleep(1.0)
        _closed(_chat(a.base, "r-x"))
        _closed(_chat(b.base, "r-x"))
        # whatever slipped in is stored but never trained with the reward
        asyncio.run(_trained_turns(pg_db, slipped.status_code == 200))
    finally:
        for r in (a, b):
            r.stop()


async def _trained_turns(url: str, slipped: bool) -> None:
    from rlproxy.storage.db import create_engine

    for _ in range(100):  # replica A commits its turn within its flush interval
        n = (await _pg(url, "SELECT count(*) AS n FROM completions"))[0]["n"]
        if n == 2 + slipped:
            break
        await asyncio.sleep(0.05)
    assert n == 2 + slipped
    engine = create_engine(url)
    try:
        (run,) = await load_runs(engine, ["r-x"])
    finally:
        await engine.dispose()
    assert len(run.completions) == 2 and run.reward == 0.9


def test_case7_responses_chain_across_two_replicas(tmp_path: Path, pg_db: str, stub_url: str):  # noqa: F811
    """Issue 22 case 7: a chain's second turn at once on the other replica finds its first turn
    (the same peer grace as a reward's). Before: `404 previous_response_not_found` 4 times in 5."""
    args = ["--backend", "vllm", "--upstream", stub_url, "--model", "stub-model", "--no-train", "--db", pg_db]
    a, b = (Replica(args, _env(tmp_path, n)) for n in "ab")
    try:
        for r in (a, b):
            r.wait_line("OPENAI_BASE_URL=")
        clients = [openai.OpenAI(base_url=f"{r.base}/v1", api_key="x", max_retries=0) for r in (a, b)]
        for i in range(5):
            first = clients[0].responses.create(
                model="stub-model", input=f"turn 1 of {i}", extra_headers={"X-Run-Id": f"chain-{i}"}
            )
            second = clients[1].responses.create(
                model="stub-model", input="turn 2", previous_response_id=first.id
            )
            assert second.id != first.id
        for _ in range(100):  # B commits the last turn within its flush interval
            rows = asyncio.run(_pg(pg_db, "SELECT run_id, count(*) AS n FROM completions GROUP BY run_id"))
            if sum(r["n"] for r in rows) == 10:
                break
            time.sleep(0.05)
        assert sorted((r["run_id"], r["n"]) for r in rows) == [(f"chain-{i}", 2) for i in range(5)]
    finally:
        for r in (a, b):
            r.stop()


def test_the_check_of_unseen_runs_reads_the_store_once_per_poll_under_steady_traffic(tmp_path: Path):
    """Runs admitted while a check's query runs wait for the next poll. Before, `check_unseen`
    looped until none was left, so under steady traffic it queried back to back on the serving loop
    (~60 queries a second of a few runs each, measured under `bench/proxy.py`'s tagged load)."""

    async def scenario() -> tuple[int, int, int]:
        from sqlalchemy import event

        from rlproxy.proxy.runstate import RunState
        from rlproxy.storage.db import create_engine, upgrade_async

        url = f"sqlite+aiosqlite:///{tmp_path / 'runs.sqlite'}"
        await upgrade_async(url)
        engine = create_engine(url)
        selects = 0

        @event.listens_for(engine.sync_engine, "before_cursor_execute")
        def count(conn, cursor, statement, *args) -> None:  # noqa: ANN001
            nonlocal selects
            selects += statement.lstrip().upper().startswith("SELECT")

        runs = RunState(engine, poll_interval=60)
        stop = asyncio.Event()

        async def traffic() -> None:  # a new run every millisecond, as a tagged load admits them
            n = 0
            while not stop.is_set():
                runs.admit(f"r-{n}")
                n += 1
                await asyncio.sleep(0.001)

        load = asyncio.create_task(traffic())
        try:
            await asyncio.sleep(0.05)
            queued = len(runs._unseen)
            # takes the queued runs; new ones keep arriving meanwhile (the old loop never returned)
            await asyncio.wait_for(runs.check_unseen(), 10)
            return queued, selects, len(runs._unseen)
        finally:
            stop.set()
            await load
            await engine.dispose()

    queued, selects, left = asyncio.run(scenario())
    assert queued > 0
    assert selects == 1  # one query for the runs queued when the check began (fewer than 500)
    assert left > 0  # those admitted meanwhile wait for the next poll


def test_a_run_rewarded_before_its_background_check_is_not_taken_for_a_late_one(make_proxy, stub):
    """Rewarded here between its first turn and the poll's check: the check finds it closed, and
    that is this replica's own reward, not a run closed elsewhere before it was seen (before, each
    one counted as `late` with a warning: under the benchmark's tagged load with rewards flowing, a
    flood of them filled the unread log pipe and blocked the serving loop)."""
    proxy = make_proxy(stub.url, run_state_poll_interval=1.0)
    assert _chat(proxy.url, "r-1").status_code == 200
    assert httpx.post(f"{proxy.url}/v1/runs/r-1/reward", json={"reward": 0.5}).status_code == 200
    _settled(proxy.state.runs)
    assert proxy.state.runs.lookups == 1 and proxy.state.runs.late == 0
    _closed(_chat(proxy.url, "r-1"))


def test_a_reward_committed_before_its_route_hears_of_it_is_not_a_late_run(make_proxy, stub):
    """The background check can read the reward's commit before the reward route (awaiting the
    writer) marks the run closed; a run whose reward this replica is storing is its own, not a late
    one. Without `RunState.closing` the same check counts it late (the second half)."""
    first = make_proxy(stub.url)
    for run_id in ("r-race", "r-other"):
        assert _chat(first.url, run_id).status_code == 200
        assert httpx.post(f"{first.url}/v1/runs/{run_id}/reward", json={"reward": 0.5}).status_code == 200
    first.stop()

    async def scenario() -> list:
        from rlproxy.proxy.runstate import RunState
        from rlproxy.storage.db import create_engine

        engine = create_engine(str(first.db_path))
        runs = RunState(engine, poll_interval=60)  # no load(): both runs are unseen here
        try:
            assert runs.admit("r-race") == "r-race" and runs.admit("r-other") == "r-other"
            with runs.closing("r-race"):  # the route awaits the writer's commit meanwhile
                await runs.check_unseen()
                during = (runs.late, runs.is_closed("r-race"), runs.is_closed("r-other"))
                runs.close("r-race")
            return [during, runs.late, runs.is_closed("r-race"), runs._closing]
        finally:
            await engine.dispose()

    # r-other was closed elsewhere: late; r-race is this replica's own reward: closed, not late
    assert asyncio.run(scenario()) == [(1, False, True), 1, True, {}]


@pytest.mark.parametrize("writer_process", [True, False])
def test_a_run_reads_back_at_once_while_its_rows_are_still_queued(make_proxy, stub, writer_process: bool):
    """GET /v1/runs/{id} right after its first answer: the writer (batching for 5 s) commits first."""
    proxy = make_proxy(stub.url, flush_interval=5.0, writer_process=writer_process)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused")
    client.chat.completions.create(model="stub-model", messages=MSG, extra_headers={"X-Run-Id": "fresh"})
    t0 = time.monotonic()
    got = httpx.get(f"{proxy.url}/v1/runs/fresh", timeout=30)
    assert got.status_code == 200 and time.monotonic() - t0 < 4.0, got.text
    assert len(got.json()["completions"]) == 1
    missing = httpx.get(f"{proxy.url}/v1/runs/never-seen", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
