"""The canary panel: GET /rollouts (public page) and GET /v1/training/rollouts (operators: both arms'
rewarded runs in order, what the page draws), on a real SQLite store."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace

import httpx
from fastapi import FastAPI

import rlproxy.proxy as proxy_pkg
from rlproxy.proxy import errors, routes_rollouts
from rlproxy.proxy.auth import is_admin_path
from rlproxy.proxy.rules import PUBLIC_PATHS
from rlproxy.storage import rollouts as store
from rlproxy.storage import shadow as shadow_store
from rlproxy.storage.db import create_engine, upgrade


async def test_panel_page_and_data(tmp_path: Path) -> None:
    db = tmp_path / "rlproxy.db"
    url = f"sqlite+aiosqlite:///{db}"
    upgrade(url)
    with sqlite3.connect(db) as con:
        con.execute(
            "INSERT INTO training_steps (step, policy, adapter_path, kind) VALUES (1, 'p', '/ck', 'grpo')"
        )
    engine = create_engine(url)
    try:
        rid, _ = await store.begin(engine, "p", 1, 0.5)
        with sqlite3.connect(db) as con:
            for i, (step, reward) in enumerate([(1, 1.0), (0, 0.0), (1, 0.5), (0, 1.0)]):
                t = f"2099-01-01 00:00:0{i}"
                con.execute(
                    "INSERT INTO runs (id, policy, status, reward, created_at, completed_at, split, "
                    "next_seq) VALUES (?, 'p', 'completed', ?, ?, ?, 'train', 1)",
                    (f"r{i}", reward, t, t),
                )
                con.execute(
                    "INSERT INTO completions (run_id, seq, policy, policy_step, created_at) "
                    "VALUES (?, 0, 'p', ?, ?)",
                    (f"r{i}", step, t),
                )
        app = FastAPI()
        app.state.proxy = SimpleNamespace(engine=engine)
        errors.install(app)
        app.include_router(routes_rollouts.router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            page = await http.get("/rollouts")
            assert page.status_code == 200 and "/v1/training/rollouts" in page.text
            body = (await http.get("/v1/training/rollouts")).json()
            assert [r["id"] for r in body["data"]] == [rid] and body["chart"]["candidate_step"] == 1
            assert [(s["arm"], s["reward"]) for s in body["chart"]["series"]] == [
                ("candidate", 1.0),
                ("incumbent", 0.0),
                ("candidate", 0.5),
                ("incumbent", 1.0),
            ]
            missing = await http.get("/v1/training/rollouts?id=99")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    finally:
        await engine.dispose()
    assert "/rollouts" in PUBLIC_PATHS and is_admin_path("/v1/training/rollouts")


async def test_shadow_checks_route_and_page(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}"
    upgrade(url)
    engine = create_engine(url)
    try:
        cid = await shadow_store.start_check(
            engine, policy="<b>p</b>", step=2, serving=1, margin=0.05, scorer="checks"
        )
        pairs = [{"completion_id": 7, "candidate": 0.0, "serving": 1.0}]
        await shadow_store.finish_check(
            engine,
            cid,
            status="failed",
            reason="r",
            prompts=1,
            candidate_score=0.0,
            serving_score=1.0,
            pairs=pairs,
        )
        app = FastAPI()
        app.state.proxy = SimpleNamespace(engine=engine)
        errors.install(app)
        app.include_router(routes_rollouts.router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            [row] = (await http.get("/v1/training/shadow_checks?policy=<b>p</b>")).json()["data"]
            assert (row["candidate_step"], row["serving_step"], row["status"], row["pairs"]) == (
                2,
                1,
                "failed",
                pairs,
            )
            assert (await http.get("/v1/training/shadow_checks?policy=q")).json()["data"] == []
            assert (await http.get("/v1/training/shadow_checks?limit=0")).status_code == 422
            assert "rollouts.js" in (await http.get("/rollouts")).text
    finally:
        await engine.dispose()
    assert is_admin_path("/v1/training/shadow_checks")
    # data reaches the page as text (cell() sets textContent), never as HTML
    page = (Path(proxy_pkg.__file__).parent / "static" / "rollouts.js").read_text()
    assert "v1/training/shadow_checks" in page and "td.textContent" in page and "innerHTML" not in page
