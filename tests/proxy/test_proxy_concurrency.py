"""Concurrency, streaming disconnects, and rewards racing their run's last stream."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai

MESSAGES = [{"role": "user", "content": "Count."}]


async def test_200_concurrent_requests_over_50_runs(engine_proxy):
    client = openai.AsyncOpenAI(base_url=f"{engine_proxy.url}/v1", api_key="x", max_retries=0, timeout=120)

    async def one(i: int):
        return await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=2,
            stream=i % 3 == 0,
            extra_headers={"X-Run-Id": f"run-{i % 50}"},
        )

    results = await asyncio.gather(*(one(i) for i in range(200)))
    for r in results:  # drain the streams
        if isinstance(r, openai.AsyncStream):
            async for _ in r:
                pass
    rows = engine_proxy.query("SELECT run_id, seq, status FROM completions ORDER BY run_id, seq")
    assert len(rows) == 200
    by_run: dict[str, list[int]] = {}
    for run_id, seq, status in rows:
        assert status == "ok"
        by_run.setdefault(run_id, []).append(seq)
    assert len(by_run) == 50
    assert all(seqs == [0, 1, 2, 3] for seqs in by_run.values())
    assert engine_proxy.query("SELECT count(*) FROM runs") == [(50,)]


def test_stream_disconnect_cancels_upstream_and_stores_partial(make_proxy, stub):
    proxy = make_proxy(stub.url)
    body = {"model": "stub-model", "stream": True, "messages": MESSAGES}
    headers = {"X-Run-Id": "gone", "x-stub-delay": "4"}  # 8 tokens, one every 0.5 s
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data:") and '"content":"t' in line:
                seen += 1
                if seen == 2:
                    break
    # the client is gone: the proxy stores the partial completion and drops the upstream call
    deadline = time.monotonic() + 10
    rows = []
    while time.monotonic() < deadline and not rows:
        rows = proxy.query("SELECT status, status_code, token_ids, response, error FROM completions")
        time.sleep(0.1)
    ((status, code, token_ids, response, error),) = rows
    assert status == "cancelled" and code == 499 and "disconnect" in error
    ids = json.loads(token_ids)[0]
    assert 2 <= len(ids) < 8
    assert json.loads(response)["choices"][0]["message"]["content"].startswith("t100 t101")
    deadline = time.monotonic() + 5
    while stub.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stub.disconnects == 1  # the upstream stopped generating


def test_reward_waits_for_the_runs_stream_to_be_stored(make_proxy, stub):
    """A reward posted right after the last chunk still sees that stream's completion."""
    proxy = make_proxy(stub.url, flush_interval=0.2)
    for i in range(5):
        run = f"race-{i}"
        with httpx.stream(
            "POST",
            f"{proxy.url}/v1/chat/completions",
            headers={"X-Run-Id": run},
            json={"model": "stub-model", "stream": True, "messages": MESSAGES},
        ) as resp:
            for _ in resp.iter_bytes():
                pass
        r = httpx.post(f"{proxy.url}/v1/runs/{run}/reward", json={"reward": float(i)})
        assert r.status_code == 200, r.text
    assert proxy.query("SELECT count(*) FROM runs WHERE status = 'completed'") == [(5,)]
