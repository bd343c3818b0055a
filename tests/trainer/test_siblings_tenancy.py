"""Siblings under app keys (issues 54 and 55): a key's sibling groups go to that key's own scorer,
carry that key, and stay in that key's namespace.

Real parts: `build_app` (what `rlproxy serve` runs) on the embedded engine with the tiny model, a
SQLite file, `siblings=new`, K = 3, `scorer=url` with a global `scorer_url`, and three url scorers
on loopback (A's, B's and the global one) that record every body they get. Keys A and B are made
with the store function `rlproxy keys create` calls, each with its own `scorer_url`.

What a sibling member's id is: the group is `sib-<completion id>`, its members `sib-<id>:<i>`; a
keyed call's members are stored in its key's namespace (`key_..~sib-<id>:<i>`, `runs.key_id` its key),
like every run of that app. So the app reads its own members by `sib-<id>:<i>`, and neither another
key nor the shared agents' key (`RLPROXY_API_KEY`) reaches them: the same 404 as a run nobody made.
Before this test, members were stored as `sib-<id>:<i>` for every key: the shared agents' key read
app A's members (A's prompt, in member 0's copy of A's request), and A could not. Nor is the global
`scorer_api_key` (the operator's secret for the global scorer) sent to a key's own scorer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from serving import rows
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support import free_port

from rlproxy.compose import build_app
from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.settings import Settings
from rlproxy.storage import keys as keystore

AGENT, ADMIN, SCORER_KEY = "shared-agents-key", "operators-key", "sk-global-scorer"
SECRETS = {"a": "alpha-secret-5f1c", "b": "bravo-secret-8e2d", "shared": "charlie-secret-3a9b"}


class Recorder:
    """A url scorer on loopback: records each body and its Authorization; scores by index."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/score"

    async def _score(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("authorization"))
        return JSONResponse({"scores": [0.1 * c["index"] for c in body["candidates"]]})

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Recorder]:
        app = Starlette(routes=[Route("/score", self._score, methods=["POST"])])
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
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


@contextlib.asynccontextmanager
async def proxy(settings: Settings, backend: Any) -> AsyncIterator[tuple[str, Any]]:
    """`build_app` under uvicorn on loopback: its base URL and its `ProxyState`."""
    app = build_app(settings, backend)
    server = uvicorn.Server(uvicorn.Config(app, port=settings.port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(1200):
            if server.started:
                break
            assert not task.done(), "the proxy exited during startup"
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{settings.port}", app.state.proxy
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)


async def test_each_keys_siblings_go_to_its_own_scorer_and_stay_its_own(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    db = tmp_path / "rlproxy.db"
    rec_a, rec_b, rec_global = Recorder(), Recorder(), Recorder()
    settings = Settings(
        model=str(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{db}",
        port=free_port(),
        api_key=AGENT,
        admin_key=ADMIN,
        poll_interval=0.1,
        engine_threads=1,
        siblings="new",
        siblings_k=3,
        siblings_max_share=1.0,
        scorer="url",
        scorer_url=rec_global.url,
        scorer_api_key=SCORER_KEY,
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    async with (
        rec_a.serving(),
        rec_b.serving(),
        rec_global.serving(),
        proxy(settings, backend) as (base, state),
        httpx.AsyncClient(timeout=60) as http,
    ):
        auth = {"shared": {"Authorization": f"Bearer {AGENT}"}}
        key_ids = {}
        for name, rec in (("a", rec_a), ("b", rec_b)):
            row, secret = await keystore.create(state.engine, f"app-{name}", scorer_url=rec.url)
            key_ids[name], auth[name] = row["id"], {"Authorization": f"Bearer {secret}"}
        await state.keys.refresh()

        for who in ("a", "b", "shared"):
            body = {
                "model": backend.served_model,
                "messages": [{"role": "user", "content": f"Repeat {SECRETS[who]} please."}],
                "max_tokens": 5,
                "temperature": 1.0,
            }
            got = await http.post(
                f"{base}/v1/chat/completions", json=body, headers={**auth[who], "X-Run-Id": f"run-{who}"}
            )
            assert got.status_code == 200, got.text

        # every call's sibling group scored (three groups, K members each)
        groups: list[tuple] = []
        for _ in range(600):
            groups = rows(
                db,
                "SELECT g.id, g.status, c.key_id FROM sibling_groups g "
                "JOIN completions c ON c.id = g.completion_id ORDER BY g.completion_id",
            )
            if len(groups) == 3 and all(s in ("scored", "failed") for _, s, _ in groups):
                break
            await asyncio.sleep(0.1)
        assert [(s, k) for _, s, k in groups] == [
            ("scored", key_ids["a"]),
            ("scored", key_ids["b"]),
            ("scored", None),
        ], groups
        gid = {who: g[0] for who, g in zip(("a", "b", "shared"), groups, strict=True)}

        # each scorer got its own app's one group, and no other app's text; the global one only the
        # shared key's; the operator's scorer_api_key went to the global scorer only
        for who, rec in (("a", rec_a), ("b", rec_b), ("shared", rec_global)):
            assert [b["group_id"] for b in rec.bodies] == [gid[who]], (who, rec.bodies)
            text = json.dumps(rec.bodies)
            assert SECRETS[who] in text
            assert not [s for other, s in SECRETS.items() if other != who and s in text], (who, text)
            assert len(rec.bodies[0]["candidates"]) == 3
        assert rec_global.auth == [f"Bearer {SCORER_KEY}"]
        assert rec_a.auth == rec_b.auth == [None]

        # the members carry their call's key, runs and completions alike, and live in its namespace
        for who in ("a", "b", "shared"):
            members = rows(
                db,
                "SELECT r.id, r.key_id, c.key_id, r.reward_source FROM runs r "
                f"JOIN completions c ON c.run_id = r.id WHERE r.group_id = '{gid[who]}' ORDER BY r.id",
            )
            key = key_ids.get(who)
            prefix = f"{key}~" if key else ""
            assert members == [(f"{prefix}{gid[who]}:{i}", key, key, "sibling") for i in range(3)], (
                who,
                members,
            )

        # a member of A's group: A reads it by the id it knows; B and the shared agents' key get the
        # 404 of a run nobody made (member 0 holds A's request, its secret included)
        member = f"{gid['a']}:0"
        mine = await http.get(f"{base}/v1/runs/{member}", headers=auth["a"])
        assert mine.status_code == 200 and mine.json()["id"] == member, mine.text
        assert SECRETS["a"] in mine.text
        for other in ("b", "shared"):
            theirs = await http.get(f"{base}/v1/runs/{member}", headers=auth[other])
            assert theirs.status_code == 404, (other, theirs.text)
            assert theirs.json()["error"]["code"] == "not_found"
            assert SECRETS["a"] not in theirs.text
        # the shared key reads its own call's members as before
        shared = await http.get(f"{base}/v1/runs/{gid['shared']}:1", headers=auth["shared"])
        assert shared.status_code == 200, shared.text
