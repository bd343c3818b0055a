"""The dashboard's data route says what to set when most rewarded runs are ungrouped (every task unique)."""

from __future__ import annotations

import sqlite3

import httpx


def test_run_stats_notice_when_most_runs_are_ungrouped(make_proxy, stub) -> None:
    proxy = make_proxy(stub.url)
    for i in range(24):  # live traffic: every request a new task, so every run a group of its own
        body = {"model": "stub-model", "messages": [{"role": "user", "content": f"task {i}"}]}
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Run-Id": f"live-{i}"})
        assert r.status_code == 200
        r = httpx.post(f"{proxy.url}/v1/runs/live-{i}/reward", json={"reward": i / 24})
        assert r.status_code == 200
    stats = httpx.get(f"{proxy.url}/v1/runs/stats").json()
    assert stats["by_status"]["completed"] == 24 and stats["by_status"]["ungrouped"] == 0
    assert stats["notice"] is None

    # what the trainer does group_timeout after each reward: 13 of 24 runs had no sibling
    con = sqlite3.connect(proxy.db_path)
    with con:
        con.execute(
            "UPDATE runs SET status = 'ungrouped', status_reason = 'no_sibling' WHERE id IN "
            "(SELECT id FROM runs ORDER BY id LIMIT 13)"
        )
    con.close()
    stats = httpx.get(f"{proxy.url}/v1/runs/stats").json()
    assert stats["by_status"]["ungrouped"] == 13
    assert stats["notice"].startswith("13 of 24 rewarded runs (54%) are ungrouped")
    assert "RLPROXY_SINGLETONS=train" in stats["notice"]
    # and the page shows it next to the counters
    script = httpx.get(f"{proxy.url}/dashboard/app.js").text
    assert 'stats.notice || ""' in script and '"ungrouped"' in script
