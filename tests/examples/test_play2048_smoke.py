"""The 2048 agent, unmodified, against a real rlproxy (tiny model, embedded engine, no trainer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def proxy_url(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    import uvicorn

    from rlproxy.compose import build_app
    from rlproxy.settings import Settings

    tmp = tmp_path_factory.mktemp("play2048")
    settings = Settings(
        model=str(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{tmp / 'rlproxy.db'}",
        port=0,  # any free port, read back once started: no race with other processes
        train=False,
        engine_threads=1,
        checkpoint_dir=str(tmp / "checkpoints"),
    )
    server = uvicorn.Server(uvicorn.Config(build_app(settings), port=settings.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.1)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=60)


def test_play_a_few_moves_through_the_proxy(proxy_url: str):
    env = {**os.environ, "OPENAI_BASE_URL": f"{proxy_url}/v1", "OPENAI_API_KEY": "unused"}
    cmd = [sys.executable, str(ROOT / "examples" / "2048" / "play.py"), "--episodes", "2"]
    cmd += ["--group-size", "2", "--concurrency", "2", "--max-moves", "3", "--max-tokens", "4"]
    cmd += ["--seed", "5", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    games = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(games) == 2
    assert "2 games, mean reward" in out.stdout

    for game in games:
        # a random tiny model rarely names a move: the game ends after 3 invalid replies or 3 moves
        assert game["moves"] + game["invalid"] >= 3 or game["over"]
        assert 0.0 <= game["reward"] <= 1.0
        run = httpx.get(f"{proxy_url}/v1/runs/{game['run_id']}").json()
        assert run["status"] == "completed"
        assert run["reward"] == pytest.approx(game["reward"])
        assert run["group_id"] == game["group_id"]
        assert run["n_completions"] == game["moves"] + game["invalid"]
        assert run["metrics"]["max_tile"] == game["max_tile"]
        first = run["completions"][0]["request"]["messages"]
        assert first[0]["role"] == "system" and "Board (score 0):" in first[-1]["content"]
    assert games[0]["group_id"] == games[1]["group_id"]  # same board, same group
