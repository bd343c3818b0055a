"""Helpers of the proxy tests: a background event loop, a proxy under uvicorn, a LoRA maker.

A module of its own (not conftest.py) so tests can import it by a unique name.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

from support import LoopThread, free_port, make_lora  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parents[2]


def completion_rows(proxy: Any, where: str = "1=1", *params: Any) -> list[dict]:
    """The `completions` rows `where` holds (in id order) as dicts, their JSON columns parsed."""
    cols = (
        "run_id, seq, endpoint, stream, request, response, prompt_token_ids, token_ids, logprobs, "
        "finish_reason, status, status_code, error, response_id, client_request, client_response, "
        "prompt_tokens, completion_tokens"
    )
    names = [c.strip() for c in cols.split(",")]
    json_cols = ("request", "response", "prompt_token_ids", "token_ids", "logprobs")
    out = []
    for row in proxy.query(f"SELECT {cols} FROM completions WHERE {where} ORDER BY id", *params):
        d = dict(zip(names, row, strict=True))
        for k in (*json_cols, "client_request", "client_response"):
            if isinstance(d[k], str):
                d[k] = json.loads(d[k])
        out.append(d)
    return out


class ProxyServer:
    """A proxy app under uvicorn on the loop thread; `.url` ends without `/v1`."""

    def __init__(self, lt: LoopThread, app: Any, db_path: Path) -> None:
        import uvicorn

        self.lt = lt
        self.app = app
        self.db_path = db_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        from rlproxy.proxy import server

        # the proxy runs under the uvicorn.Config `rlproxy serve` uses (its connection limits included)
        settings = app.state.proxy.settings.model_copy(update={"host": "127.0.0.1", "port": self.port})
        self.server = uvicorn.Server(server.config(app, settings, access_log=False, log_level="warning"))

    @property
    def state(self) -> Any:
        return self.app.state.proxy

    def start(self) -> ProxyServer:
        async def go() -> None:
            self.task = asyncio.create_task(self.server.serve())
            for _ in range(600):
                if self.server.started:
                    return
                if self.task.done():
                    self.task.result()
                    raise RuntimeError("proxy server exited during startup")
                await asyncio.sleep(0.02)
            raise RuntimeError("proxy did not start")

        self.lt.run(go())
        return self

    def stop(self) -> None:
        """Shut the server down (lifespan included); idempotent."""
        if self.server.should_exit:
            return

        async def go() -> None:
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 30)

        self.lt.run(go())

    def flush(self) -> None:
        """Wait until the writer committed everything submitted so far."""
        self.lt.run(self.state.writer.flush())

    def query(self, sql: str, *params: Any) -> list[tuple]:
        """Rows of `sql` on the proxy's database, read-only, after a writer flush."""
        self.flush()
        con = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()
