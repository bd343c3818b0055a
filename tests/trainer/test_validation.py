"""Validation runs end to end: served and stored through the real proxy, never trained, scored per step.

`serve` (build_app on the embedded engine, tiny model, a real uvicorn server) trains three steps from
groups of rewarded runs. Before each step, validation runs are served by the current adapter: some
marked with the `X-Split: val` header (one of them inside a training group's X-Group-Id), one by
`"split": "val"` in its reward body. Then:

- no val run is ever in a step (status `validated`, trained_step NULL, num_runs counts training runs);
- each step's `val_reward` / `val_runs` are exactly the mean and count of the val runs the previous
  adapter served (rewards chosen so that the sums are exact in binary floating point);
- with keep_checkpoints=1 the best adapter by validation (step 1) survives pruning, step 2 does not;
- the `validation` view, `rlproxy steps` and the dashboard (headless Chromium) show the same numbers.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from openai import AsyncOpenAI
from serving import rows
from support import free_port

from rlproxy.compose import build_app
from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.settings import Settings

# phase k (k = 1, 2, 3): val runs served by adapter k-1, then two training groups -> step k.
# (header val rewards, reward-body val rewards): step k's val_reward is their mean.
VAL: dict[int, tuple[list[float], list[float]]] = {
    1: ([0.25, 0.75], [1.0]),  # adapter 0 (base): 2/3
    2: ([1.0, 1.0], [0.75]),  # adapter 1: 11/12, the best
    3: ([0.0, 0.5], []),  # adapter 2: 1/4
}
AFTER = [0.5, 0.25]  # val runs served by adapter 3 after the last step: only in the `validation` view
TRAIN = [[1.0, 0.0, 0.5, 0.0], [0.0, 0.25, 1.0, 1.0]]  # two groups of 4 per step


def _browser() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None
    return (browser, driver) if browser and driver else None


def _dashboard(url: str, tmp: Path) -> dict[str, Any]:
    """The main chart's points per series, read by headless Chromium (runs in a thread)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    found = _browser()
    assert found is not None
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--window-size=1280,1400", f"--user-data-dir={tmp / 'profile'}",
    ):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    try:
        driver.get(f"{url}/?refresh=0")
        WebDriverWait(driver, 60).until(
            lambda d: (
                d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "true"
                or d.find_element(By.ID, "error").text
            )
        )
        out: dict[str, Any] = {"error": driver.find_element(By.ID, "error").text}
        for name in ("train", "validation"):
            circles = driver.find_elements(By.CSS_SELECTOR, f'#chart circle.point[data-series="{name}"]')
            out[name] = [
                (float(c.get_attribute("data-x")), float(c.get_attribute("data-y"))) for c in circles
            ]
        out["legend"] = [t.text for t in driver.find_elements(By.CSS_SELECTOR, "#chart .legend text")]
        out["note"] = driver.find_element(By.ID, "steps-note").text
        card = driver.find_elements(By.CSS_SELECTOR, '#counts .count[data-status="validated"] b')
        out["validated"] = int(card[0].text) if card else None
        out["severe"] = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        return out
    finally:
        driver.quit()


async def test_validation_runs_scored_never_trained_best_kept(tiny_model_dir: Path, tmp_path: Path) -> None:
    db = tmp_path / "rlproxy.db"
    ck = tmp_path / "ck"
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
        checkpoint_dir=str(ck),
        keep_checkpoints=1,
        unload_grace=0,
        train_threads=1,
        engine_threads=1,
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    server = uvicorn.Server(
        uvicorn.Config(build_app(settings, backend), host="127.0.0.1", port=port, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    base = f"http://127.0.0.1:{port}"
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
    policy = backend.served_model
    val_ids: list[str] = []
    dash: dict[str, Any] | None = None

    async def call(run_id: str, headers: dict[str, str], content: str) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model=policy,
            messages=[{"role": "user", "content": content}],
            max_tokens=4,
            temperature=1.0,
            seed=len(run_id),
            extra_headers={"X-Run-Id": run_id, **headers},
        )
        return raw.headers["x-policy-step"]

    async def wait_step(step: int) -> None:
        for _ in range(2400):  # the alias flips right after the commit
            if rows(db, f"SELECT count(*) FROM training_steps WHERE step = {step}")[0][0]:
                raw = await client.chat.completions.with_raw_response.create(
                    model=policy, messages=[{"role": "user", "content": "again"}], max_tokens=1
                )
                if raw.headers["x-policy-step"] == str(step):
                    return
            await asyncio.sleep(0.05)
        raise AssertionError(f"step {step} was never published")

    try:
        for _ in range(600):
            if server.started:
                break
            assert not task.done(), "the proxy exited during startup"
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:

            async def reward(run_id: str, body: dict[str, Any]) -> httpx.Response:
                return await http.post(f"/v1/runs/{run_id}/reward", json=body)

            # the contract's edges, before anything trains
            bad = await http.post(
                "/v1/chat/completions",
                json={"model": policy, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                headers={"X-Run-Id": "bad", "X-Split": "validation"},
            )
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_split"
            assert await call("edge-h", {"X-Split": "val"}, "edge") == "0"
            resp = await reward("edge-h", {"reward": 0.5, "split": "train"})  # a val run is no train run
            assert resp.status_code == 409 and resp.json()["error"]["code"] == "split_conflict"
            assert (await reward("edge-h", {"reward": 0.5, "split": "other"})).status_code == 422
            assert await call("edge-t", {}, "edge") == "0"
            assert (await reward("edge-t", {"reward": 0.5})).status_code == 200
            resp = await reward("edge-t", {"reward": 0.5, "split": "val"})  # rewarded as train already
            assert resp.status_code == 409 and resp.json()["error"]["code"] == "split_conflict"
            # a later request's header does not change a run's split: fixed by its first request
            assert await call("edge-t2", {}, "edge") == "0"
            assert await call("edge-t2", {"X-Split": "val"}, "edge, again") == "0"
            # the edge runs are left unrewarded (open) except edge-t, alone in its group: never trained

            for k in (1, 2, 3):
                header_rewards, body_rewards = VAL[k]
                for i, r in enumerate(header_rewards):
                    run_id = f"val{k}-h{i}"
                    # the first val run of each phase sits in a training group's X-Group-Id
                    group = {"X-Group-Id": f"G{k}-0"} if i == 0 else {}
                    assert await call(run_id, {"X-Split": "val", **group}, f"Val {k}.{i}") == str(k - 1)
                    resp = await reward(run_id, {"reward": r})
                    assert resp.status_code == 200 and resp.json()["stored"] is True, resp.text
                    again = await reward(run_id, {"reward": r, "split": "val"})  # the same again: 200
                    assert again.status_code == 200 and again.json()["stored"] is False
                    val_ids.append(run_id)
                for i, r in enumerate(body_rewards):
                    run_id = f"val{k}-b{i}"
                    assert await call(run_id, {}, f"Body val {k}.{i}") == str(k - 1)
                    resp = await reward(run_id, {"reward": r, "split": "val"})
                    assert resp.status_code == 200, resp.text
                    val_ids.append(run_id)
                for g, rewards in enumerate(TRAIN):
                    for i, r in enumerate(rewards):
                        run_id = f"T{k}-{g}-{i}"
                        assert await call(run_id, {"X-Group-Id": f"G{k}-{g}"}, f"Task {k}.{g}") == str(k - 1)
                        assert (await reward(run_id, {"reward": r})).status_code == 200
                await wait_step(k)
            for i, r in enumerate(AFTER):  # served by adapter 3; no step 4 will freeze them
                assert await call(f"val4-h{i}", {"X-Split": "val"}, f"Val 4.{i}") == "3"
                assert (await reward(f"val4-h{i}", {"reward": r})).status_code == 200
                val_ids.append(f"val4-h{i}")
            listed = (await http.get("/v1/runs", params={"status": "validated", "limit": 100})).json()
            assert sorted(r["id"] for r in listed["data"]) == sorted(val_ids)
            assert {r["split"] for r in listed["data"]} == {"val"}
            if _browser() is not None:
                dash = await asyncio.to_thread(_dashboard, base, tmp_path)
            elif os.environ.get("CI") == "true":
                pytest.fail("CI needs chromium + chromedriver + selenium for the dashboard check")
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)

    # never trained: every val run is `validated`, split val, trained_step NULL; steps hold 8 runs each
    runs = {r[0]: r[1:] for r in rows(db, "SELECT id, status, split, trained_step FROM runs")}
    assert {rid: runs[rid] for rid in val_ids} == {rid: ("validated", "val", None) for rid in val_ids}
    for k in (1, 2, 3):
        assert {runs[f"T{k}-{g}-{i}"] for g in range(2) for i in range(4)} == {("trained", "train", k)}
    assert runs["edge-h"] == ("open", "val", None)  # its refused rewards changed nothing
    assert runs["edge-t"][1:] == ("train", None) and runs["edge-t2"] == ("open", "train", None)
    steps = rows(
        db, "SELECT step, num_runs, val_reward, val_runs, adapter_path FROM training_steps ORDER BY step"
    )
    assert [(s[0], s[1]) for s in steps] == [(1, 8), (2, 8), (3, 8)]

    # each step: exactly the mean of the val runs served by the previous adapter
    expected = {k: (sum(h + b) / len(h + b), len(h + b)) for k, (h, b) in VAL.items()}
    assert {s[0]: (s[2], s[3]) for s in steps} == expected
    view = {r[0]: (r[2], r[1]) for r in rows(db, "SELECT step, val_runs, val_reward FROM validation")}
    assert view == {0: expected[1], 1: expected[2], 2: expected[3], 3: (sum(AFTER) / len(AFTER), len(AFTER))}

    # retention: keep_checkpoints=1 keeps step 3 (newest) and step 1 (best by validation); 2 is pruned
    folders = sorted(p.name for p in next(ck.iterdir()).iterdir() if p.name.startswith("step-"))
    assert folders == ["step-0001", "step-0003"]
    assert [s[4] is not None for s in steps] == [True, False, True]  # the pruned step's path is forgotten

    # `rlproxy steps`: val (count) per step, `best` on the step whose checkpoint is kept for it
    from typer.testing import CliRunner

    from rlproxy.cli.main import app

    out = await asyncio.to_thread(CliRunner().invoke, app, ["steps", "--db", f"sqlite+aiosqlite:///{db}"])
    assert out.exit_code == 0, out.output
    cells = {line.split()[1]: line.split() for line in out.output.splitlines()[1:4]}
    val = {
        step: [c[i], c[i + 1]] for step, c in cells.items() for i in range(len(c) - 1) if c[i + 1][0] == "("
    }
    assert val == {"1": ["0.667", "(3)"], "2": ["0.917", "(3)"], "3": ["0.250", "(2)"]}
    assert [step for step, c in cells.items() if "best" in c] == ["1"]

    # the dashboard plots both series on the reward chart: val at step N is adapter N-1's
    if dash is not None:
        assert dash["error"] == "" and dash["severe"] == []
        assert dash["validation"] == [(float(k), expected[k][0]) for k in (1, 2, 3)]
        assert [x for x, _ in dash["train"]] == [1.0, 2.0, 3.0]
        assert dash["legend"] == ["train", "validation"]
        assert "validation 0.25" in dash["note"]
        assert dash["validated"] == len(val_ids)  # the runs-per-status counters


def test_prune_keeps_the_protected_step(tmp_path: Path) -> None:
    from rlproxy.trainer import checkpoint as ckpt

    for step in range(1, 6):
        folder = ckpt.step_dir(tmp_path, "p", step)
        folder.mkdir(parents=True)
        (folder / ckpt.STATE_FILE).write_text("{}")
    assert ckpt.prune(tmp_path, "p", 2, protect=(2,)) == [1, 3]
    assert [c.step for c in ckpt.list_checkpoints(tmp_path, "p")] == [2, 4, 5]
    assert ckpt.prune(tmp_path, "p", 2) == [2]  # no longer the best: pruned like any old step
