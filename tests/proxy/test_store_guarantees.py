"""Issue 9, case 7 ("guarantees that silently do not hold"), the store's half: a locked database
gives bounded 503s and an unhealthy /healthz instead of hangs, a reward is never acknowledged
while its run's stream still runs, and dropped records are visible on /metrics."""

from __future__ import annotations

import sqlite3
import threading
import time

import httpx
import pytest

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


def _until(fn, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        out = fn()
        if out or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def test_locked_store_gives_bounded_503_and_unhealthy_then_recovers(make_proxy, stub):
    """Case 7: with the database locked, requests past the byte cap of the write queue get 503 +
    Retry-After in OpenAI's shape within `store_wait_timeout` (they used to hang), /healthz turns 503
    after `store_unhealthy_after`; both recover once the lock is gone, and every 200 is stored."""
    proxy = make_proxy(
        stub.url, write_queue_max_bytes=2000, store_wait_timeout=0.5, store_unhealthy_after=1.0
    )
    client = httpx.Client(base_url=proxy.url, timeout=30)
    ok = 0
    assert client.post("/v1/chat/completions", json=CHAT, headers={"X-Run-Id": "r"}).status_code == 200
    proxy.flush()  # the writer has its connection; now another one takes the write lock
    lock = sqlite3.connect(proxy.db_path, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        refused = None
        for _ in range(30):
            t0 = time.monotonic()
            r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Run-Id": "r"})
            if r.status_code == 200:
                ok += 1
                continue
            refused, waited = r, time.monotonic() - t0
            break
        assert refused is not None, "the byte cap never applied"
        assert refused.status_code == 503 and 0.4 < waited < 3, (refused.status_code, waited)
        assert int(refused.headers["retry-after"]) >= 1
        err = refused.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "store_unavailable"

        health = _until(lambda: (h := client.get("/healthz")).status_code == 503 and h)
        assert health and health.json()["status"] == "store_unhealthy"
        assert health.json()["store"]["stalled_s"] > 1.0
        metrics = client.get("/metrics").text
        assert _metric(metrics, "rlproxy_store_healthy") == 0.0
        assert _metric(metrics, "rlproxy_write_queue_bytes") >= 2000
    finally:
        lock.execute("COMMIT")
        lock.close()
    assert _until(lambda: client.get("/healthz").status_code == 200)
    assert client.post("/v1/chat/completions", json=CHAT, headers={"X-Run-Id": "r"}).status_code == 200
    assert _metric(client.get("/metrics").text, "rlproxy_store_healthy") == 1.0
    assert proxy.query("SELECT count(*) FROM completions") == [(ok + 2,)]  # every 200 is stored
    client.close()


def test_reward_during_a_running_stream_is_503_then_200(make_proxy, stub):
    """Case 7: a reward posted while its run's stream is still running used to return 200 once the
    stream ended (or after upstream_timeout); now it is 503 + Retry-After, and 200 after the stream."""
    proxy = make_proxy(stub.url, store_wait_timeout=0.5)
    done = threading.Event()
    got: dict = {}

    def stream() -> None:
        body = {**CHAT, "stream": True}
        headers = {"X-Run-Id": "s1", "x-stub-delay": "3"}
        with httpx.stream(
            "POST", f"{proxy.url}/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as r:
            chunks = r.iter_bytes()
            got["first"] = next(chunks)
            got["started"] = time.monotonic()
            got["rest"] = b"".join(chunks)
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    assert _until(lambda: "started" in got, 10)
    t0 = time.monotonic()
    r = httpx.post(f"{proxy.url}/v1/runs/s1/reward", json={"reward": 1.0}, timeout=30)
    assert not done.is_set(), "the stream ended before the reward was answered"
    assert r.status_code == 503 and time.monotonic() - t0 < 2
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "store_unavailable"
    t.join(30)
    assert b"[DONE]" in got["rest"]
    refused = 0  # a loaded box can take over 0.5 s to commit the stream and the reward: retried
    while (
        r := httpx.post(f"{proxy.url}/v1/runs/s1/reward", json={"reward": 1.0}, timeout=30)
    ).status_code == 503:
        refused += 1
        assert refused < 5, r.text
        time.sleep(float(r.headers["retry-after"]))
    # a retry may find the reward its 503'd try had begun to commit: the same reward, stored before
    assert r.status_code == 200 and (r.json()["stored"] is True or refused), (refused, r.text)
    assert proxy.query("SELECT r.reward, count(c.id) FROM runs r JOIN completions c ON c.run_id = r.id") == [
        (1.0, 1)
    ]


def test_dropped_records_are_a_prometheus_counter(make_proxy, stub, monkeypatch):
    """Case 7: the writer's dropped-record count is on /metrics (it was only in the log).

    An unserializable record is now stored as a plain copy (records.storable, issue 22); here
    that copy cannot help either (storable returns the record as it is), so the record is dropped."""
    from rlproxy.storage import writer as writer_module

    monkeypatch.setattr(writer_module, "storable", lambda rec, reason: rec)
    proxy = make_proxy(stub.url)
    from rlproxy.storage.records import CompletionRecord

    async def submit_unstorable() -> None:
        proxy.state.writer.submit(CompletionRecord(run_id="bad", request={"x": object()}))
        await proxy.state.writer.flush()

    proxy.lt.run(submit_unstorable())
    text = httpx.get(f"{proxy.url}/metrics").text
    assert _metric(text, "rlproxy_write_dropped_total") == 1.0
    assert httpx.get(f"{proxy.url}/healthz").json()["store"]["dropped"] == 1


@pytest.fixture(autouse=True)
def _quiet_writer_logs(caplog):
    caplog.set_level("CRITICAL", logger="rlproxy.storage.writer")


def test_a_killed_writer_process_is_replaced_and_counted_on_metrics(make_proxy, stub):
    """SIGKILL of `serve`'s writer process: the next one stores what the dead one had not, each
    completion once, and /metrics counts the restart (`rlproxy_writer_restarts_total`)."""
    import os
    import signal

    proxy = make_proxy(stub.url)
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}

    def chat(i: int) -> None:
        resp = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Run-Id": f"r-{i // 3}"})
        assert resp.status_code == 200

    for i in range(6):
        chat(i)
    proxy.flush()
    first = proxy.state.writer.runner.child.proc.pid
    os.kill(first, signal.SIGKILL)
    for i in range(6, 12):
        chat(i)
    assert httpx.post(f"{proxy.url}/v1/runs/r-3/reward", json={"reward": 1.0}, timeout=30).status_code == 200
    proxy.flush()
    assert proxy.state.writer.runner.child.proc.pid != first
    assert _metric(httpx.get(f"{proxy.url}/metrics").text, "rlproxy_writer_restarts_total") == 1.0
    assert proxy.query(
        "SELECT run_id, count(*), min(seq), max(seq) FROM completions GROUP BY run_id ORDER BY 1"
    ) == [(f"r-{k}", 3, 0, 2) for k in range(4)]
