"""End to end through the proxy: the openai SDK, runs and rewards over HTTP, the trainer inside `serve`.

2 groups x 4 runs with varied rewards (+ 1 group whose rewards are all equal) -> one step -> the next
response carries `X-Policy-Step: 1`, the runs are `trained`, a `training_steps` row exists, and the
all-equal group ends `skipped`; the trainer trained on the engine's own base weight tensors (one
copy in memory: issue 21 item 7). The app is `build_app` (what `rlproxy serve` runs) on the embedded
engine with the tiny model, under a real uvicorn server on a loopback port.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import uvicorn
from openai import AsyncOpenAI
from serving import rows
from support import free_port

from rlproxy.compose import build_app
from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.settings import Settings
from rlproxy.trainer.service import TrainerService


async def test_rewarded_groups_train_and_publish(tiny_model_dir: Path, tmp_path: Path) -> None:
    db = tmp_path / "rlproxy.db"
    port = free_port()
    settings = Settings(
        model=str(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{db}",
        port=port,
        train=True,
        group_size=4,
        groups_per_step=2,
        poll_interval=0.1,
        learning_rate=1e-3,
        checkpoint_dir=str(tmp_path / "ck"),
        train_threads=1,
        engine_threads=1,
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    app = build_app(settings, backend)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(600):
            if server.started:
                break
            assert not task.done(), "the proxy exited during startup"
            await asyncio.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        policy = backend.served_model
        # Z (all equal, skipped) goes first: once B's last reward is in, the step may be published
        # before the next request, which would then carry X-Policy-Step 1
        rewards = {"Z": [0.5] * 4, "A": [1.0, 0.0, 0.5, 0.0], "B": [0.0, 0.25, 1.0, 1.0]}
        async with httpx.AsyncClient(base_url=base) as http:
            for group, rs in rewards.items():
                for i, r in enumerate(rs):
                    run_id = f"{group}-{i}"
                    raw = await client.chat.completions.with_raw_response.create(
                        model=policy,
                        messages=[{"role": "user", "content": f"Task {group}: say a word."}],
                        max_tokens=4,
                        temperature=1.0,
                        seed=i,
                        extra_headers={"X-Run-Id": run_id, "X-Group-Id": group},
                    )
                    assert raw.headers["x-policy-step"] == "0"
                    resp = await http.post(f"/v1/runs/{run_id}/reward", json={"reward": r})
                    assert resp.status_code == 200, resp.text
            # the trainer polls, trains one step on A and B, publishes policy@1 and flips the alias
            for _ in range(1200):
                if rows(db, "SELECT count(*) FROM training_steps")[0][0]:
                    break
                await asyncio.sleep(0.05)
            step = None
            for _ in range(200):  # the alias flips right after the commit
                raw = await client.chat.completions.with_raw_response.create(
                    model=policy, messages=[{"role": "user", "content": "again"}], max_tokens=2
                )
                step = raw.headers["x-policy-step"]
                if step == "1":
                    break
                await asyncio.sleep(0.05)
            assert step == "1"
            steps = (await http.get("/v1/training/steps")).json()
            # the learner's base weights are the engine's tensors (`share_base_weights`, on by default)
            (service,) = [s for s in app.state.proxy.services if isinstance(s, TrainerService)]
            learner = service._learners[policy]
            engine_ptrs = {p.data_ptr() for p in backend.engine.adapters.base.parameters()}
            base_ptrs = {p.data_ptr() for n, p in learner.model.named_parameters() if ".lora_" not in n}
            assert base_ptrs and base_ptrs <= engine_ptrs
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)
    status = dict(rows(db, "SELECT id, status || ':' || coalesce(trained_step, '') FROM runs"))
    assert {status[f"{g}-{i}"] for g in "AB" for i in range(4)} == {"trained:1"}
    assert {status[f"Z-{i}"] for i in range(4)} == {"skipped:"}
    assert rows(db, "SELECT step, policy, num_groups, num_runs FROM training_steps") == [(1, policy, 2, 8)]
    assert steps  # the query route shows it too
