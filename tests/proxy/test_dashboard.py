"""The dashboard in a real browser: headless Chromium against a real proxy (tiny model) with data.

The database is filled through the storage writer (runs, rewards) and `commit_step` (training
steps), plus one real chat completion through the proxy; then the page must draw one chart point
per step, count runs per status and list the runs with their messages.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlproxy.proxy.dashboard import ASSETS, PUBLIC_PATHS

STEPS = [(1, 0.1), (2, 0.35), (3, 0.5), (4, 0.8), (5, 0.9)]
API_KEY = "dash-secret"  # the agents' key: the live request below
ADMIN_KEY = "dash-admin"  # the operators' key: the dashboard's data


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def browser_paths() -> tuple[str, str]:
    found = _chromium()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI needs chromium + chromedriver (apt-get install chromium chromium-driver)")
        pytest.skip("chromium/chromedriver not installed (Debian: apt-get install chromium chromium-driver)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("selenium is required in CI (it is in the dev extra)")
        pytest.skip("selenium not installed (pip install selenium)")
    return found


async def _fill(db_url: str) -> None:
    """Six rewarded two-call runs in three statuses, one open run, and five training steps."""
    from rlproxy.storage.db import create_engine, upgrade_async
    from rlproxy.storage.records import CompletionRecord
    from rlproxy.storage.training import commit_step
    from rlproxy.storage.writer import Writer

    await upgrade_async(db_url)
    engine = create_engine(db_url)
    writer = Writer(engine)
    await writer.start()
    runs = [f"dash-run-{i}" for i in range(7)]
    for i, run_id in enumerate(runs):
        messages = [{"role": "user", "content": f"Pick a number between 1 and 10 (run {i})."}]
        for turn in range(2):
            answer = {"role": "assistant", "content": f"answer {i}.{turn}"}
            writer.submit(
                CompletionRecord(
                    run_id=run_id,
                    group_id="dash-group-a" if i < 4 else "dash-group-b",
                    policy="tiny",
                    adapter="tiny",
                    policy_step=0,
                    endpoint="chat.completions",
                    stream=False,
                    request={"model": "tiny", "messages": messages},
                    response={"choices": [{"index": 0, "message": answer, "finish_reason": "stop"}]},
                    status="ok",
                    status_code=200,
                )
            )
            messages = [*messages, answer, {"role": "user", "content": "Add one."}]
        if i < 6:
            await writer.reward(run_id, 0.1 * i, {"digits_only": 1.0})
    await writer.close()
    # runs 0-3 trained by steps 1 and 2; steps 3-5 carry only their mean reward
    trained = {1: runs[:2], 2: runs[2:4]}
    for step, mean in STEPS:
        ids = trained.get(step, [])
        await commit_step(engine, policy="tiny", step=step, run_ids=ids, adapter_path=None, mean_reward=mean)
    await engine.dispose()


class _Server:
    """build_app(settings) served by uvicorn in a thread, on a loopback port."""

    def __init__(self, app, port: int = 0) -> None:  # noqa: ANN001
        import uvicorn

        self.url = ""
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + 180
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    from rlproxy.compose import build_app
    from rlproxy.settings import Settings

    tmp = tmp_path_factory.mktemp("dashboard")
    db_url = f"sqlite+aiosqlite:///{tmp / 'rlproxy.db'}"
    asyncio.run(_fill(db_url))
    settings = Settings(
        model=str(tiny_model_dir),
        db_url=db_url,
        port=0,  # any free port, read back once started: no race with other processes
        train=False,
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
        engine_threads=1,
        checkpoint_dir=str(tmp / "checkpoints"),
    )
    with _Server(build_app(settings)) as server:
        # one real request through the proxy, so a run made by the live path is on the page too
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {API_KEY}", "X-Run-Id": "dash-live"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        yield server


def test_page_and_assets_are_public(proxy):
    page = httpx.get(f"{proxy.url}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for src in ASSETS:
        assert f'src="dashboard/{src}"' in page.text
        asset = httpx.get(f"{proxy.url}/dashboard/{src}")
        assert asset.status_code == 200 and "javascript" in asset.headers["content-type"]
    assert "http" not in page.text.split("<body>")[1].replace("http://www.w3.org", "")  # nothing from a CDN
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for name in ("settings.py", "index.html"):  # only the listed scripts are served
        assert httpx.get(f"{proxy.url}/dashboard/{name}", headers=auth).status_code == 404
    escaped = httpx.get(f"{proxy.url}/dashboard/..%2Fsettings.py", headers=auth)
    assert escaped.status_code == 400  # not a canonical path
    assert httpx.get(f"{proxy.url}/v1/runs").status_code == 401  # the data stays protected
    agent = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{proxy.url}/v1/runs", headers=agent).status_code == 403  # and is the operators'
    page_reads = ("/v1/runs?limit=25", "/v1/runs/stats", "/v1/training/steps?limit=9", "/v1/runs/dash-run-3")
    for path in page_reads:
        assert httpx.get(f"{proxy.url}{path}", headers=auth).status_code == 200, path
    assert set(PUBLIC_PATHS) == {"/", "/dashboard/app.js", "/dashboard/chart.js"}


def test_dashboard_in_chromium(proxy, browser_paths, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser, driver_path = browser_paths
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(f"{proxy.url}/?key={ADMIN_KEY}&refresh=0")
        WebDriverWait(driver, 60).until(
            lambda d: (
                d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "true"
                or d.find_element(By.ID, "error").text
            )
        )
        assert driver.find_element(By.ID, "error").text == ""

        # the chart: one point per training step, at the step's mean reward, in step order
        points = driver.find_elements(By.CSS_SELECTOR, "#chart circle.point")
        assert [(float(p.get_attribute("data-x")), float(p.get_attribute("data-y"))) for p in points] == [
            (float(s), m) for s, m in STEPS
        ]
        assert driver.find_element(By.CSS_SELECTOR, "#chart polyline.line").get_attribute("points")
        ys = [float(p.get_attribute("cy")) for p in points]
        assert ys == sorted(ys, reverse=True)  # rising reward = points going up the screen

        # runs per status: 4 trained, 2 completed (rewarded, not trained), 2 open (one filled, one live)
        counts = {
            c.get_attribute("data-status"): int(c.find_element(By.TAG_NAME, "b").text)
            for c in driver.find_elements(By.CSS_SELECTOR, "#counts .count")
        }
        assert counts["trained"] == 4 and counts["completed"] == 2 and counts["open"] == 2, counts

        # the runs table, newest first, and the selected run's messages
        rows = driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr.run")
        ids = [r.get_attribute("data-run-id") for r in rows]
        assert set(ids) == {f"dash-run-{i}" for i in range(7)} | {"dash-live"}
        rows[ids.index("dash-run-3")].click()
        WebDriverWait(driver, 30).until(lambda d: "dash-run-3" in d.find_element(By.ID, "trajectory").text)
        trajectory = driver.find_element(By.ID, "trajectory").text
        assert "Pick a number between 1 and 10 (run 3)." in trajectory
        assert "answer 3.1" in trajectory

        # no script errors
        errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
    finally:
        driver.quit()
