"""The dashboard in a real browser: headless Chromium against a real proxy (tiny model) with data.

The database is filled through the storage writer (runs, rewards) and `commit_step` (training
steps), plus one real chat completion through the proxy; then the page must draw one chart point
per step, every group over time (the skipped one marked), SFT steps on their own axis, open on the
trained policy rather than an empty fork, count runs per status (clickable), filter, search and page
the runs, and show a run's page with every call (issue 26, item 3). The page and its files carry a
strict CSP, never framing, nosniff; the admin key travels in the URL's fragment only (issue 22,
case 14). Screenshots: set RLPROXY_DASHBOARD_SHOTS=DIR.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from dashboard_browser import browser_paths, chromium, counts, loaded, no_script_errors, points, shot  # noqa: F401

from rlproxy.proxy.dashboard import ASSETS, PUBLIC_PATHS

STEPS = [(1, 0.1), (2, 0.35), (3, 0.5), (4, 0.8), (5, 0.9)]
SFT_STEP, SFT_LOSS = 6, 7.25  # a supervised step: its cross-entropy must not share GRPO's loss axis
BULK = 24  # one-call open runs, so that the list has two pages of 25
API_KEY = "dash-secret"  # the agents' key: the live request below
ADMIN_KEY = "dash-admin"  # the operators' key: the dashboard's data


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
    for j in range(2):  # a group whose rewards are all equal: skipped, never a training step
        run_id = f"dash-flat-{j}"
        writer.submit(_record(run_id, "dash-group-c", [{"role": "user", "content": "Say yes."}], "yes"))
        await writer.reward(run_id, 1.0)
    for j in range(BULK):
        writer.submit(
            _record(f"dash-bulk-{j:02d}", "dash-group-d", [{"role": "user", "content": f"bulk {j}"}], "ok")
        )
    await writer.close()
    from sqlalchemy import text

    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE runs SET status = 'skipped', status_reason = 'zero_variance' "
                "WHERE group_id = 'dash-group-c'"
            )
        )
    # runs 0-3 trained by steps 1 and 2; steps 3-5 carry only their mean reward
    trained = {1: runs[:2], 2: runs[2:4]}
    for step, mean in STEPS:
        ids = trained.get(step, [])
        await commit_step(engine, policy="tiny", step=step, run_ids=ids, adapter_path=None, mean_reward=mean)
    await commit_step(
        engine,
        policy="tiny",
        step=SFT_STEP,
        run_ids=[],
        adapter_path=None,
        loss=SFT_LOSS,
        columns={"kind": "sft"},
    )
    # a fork made last: the newest step is the fork's, which has trained nothing yet
    await commit_step(
        engine, policy="dash-fork", step=1, run_ids=[], adapter_path=None, columns={"kind": "fork"}
    )
    await engine.dispose()


def _record(run_id: str, group: str, messages: list, answer: str):  # noqa: ANN202
    from rlproxy.storage.records import CompletionRecord

    return CompletionRecord(
        run_id=run_id,
        group_id=group,
        policy="tiny",
        adapter="tiny",
        policy_step=0,
        endpoint="chat.completions",
        stream=False,
        request={"model": "tiny", "messages": messages},
        response={
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}
            ]
        },
        status="ok",
        status_code=200,
    )


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
    rollouts = httpx.get(f"{proxy.url}/rollouts")
    for src in ASSETS:
        assert f'="dashboard/{src}"' in page.text + rollouts.text  # each file is on a page
        asset = httpx.get(f"{proxy.url}/dashboard/{src}")
        assert asset.status_code == 200 and asset.headers["content-type"] == ASSETS[src]
    assert "http" not in page.text.split("<body>")[1].replace("http://www.w3.org", "")  # nothing from a CDN
    assert "<style" not in page.text and " style=" not in page.text  # the CSP allows no inline style
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for name in ("settings.py", "index.html"):  # only the listed files are served
        assert httpx.get(f"{proxy.url}/dashboard/{name}", headers=auth).status_code == 404
    escaped = httpx.get(f"{proxy.url}/dashboard/..%2Fsettings.py", headers=auth)
    assert escaped.status_code == 400  # not a canonical path
    assert httpx.get(f"{proxy.url}/v1/runs").status_code == 401  # the data stays protected
    agent = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{proxy.url}/v1/runs", headers=agent).status_code == 403  # and is the operators'
    page_reads = (
        "/v1/admin/runs?limit=25&offset=0",
        "/v1/runs/stats",
        "/v1/training/metrics?limit=1000",
        "/v1/training/groups?limit=2000&policy=tiny",
        "/v1/admin/untagged?limit=10",
        "/v1/runs/dash-run-3",
    )
    for path in page_reads:
        assert httpx.get(f"{proxy.url}{path}", headers=auth).status_code == 200, path
        if not path.startswith("/v1/runs/dash"):  # a run by its id is the agents' too (its capability)
            assert httpx.get(f"{proxy.url}{path}", headers=agent).status_code == 403, path
    assert set(PUBLIC_PATHS) == {"/", *(f"/dashboard/{name}" for name in ASSETS)}


def test_security_headers(proxy):
    """Issue 22 case 14: no framing, no sniffing, only this origin's scripts and styles."""
    for path in ("/", "/dashboard/app.js", "/dashboard/style.css"):
        headers = httpx.get(f"{proxy.url}{path}").headers
        csp = headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "'unsafe" not in csp, path
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"


def test_no_api_docs_for_agents(proxy):
    """Issue 22 case 14: `/docs` (and the OpenAPI schema it reads) was open to anyone with the agents' key."""
    for key in (API_KEY, ADMIN_KEY):
        for path in ("/docs", "/openapi.json", "/redoc"):
            r = httpx.get(f"{proxy.url}{path}", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 404 and "swagger" not in r.text.lower(), (path, r.status_code)


def test_dashboard_routes(proxy):
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    groups = httpx.get(f"{proxy.url}/v1/training/groups?policy=tiny", headers=auth).json()["data"]
    by_id = {g["group_id"]: g for g in groups}
    # group a's runs were trained by two steps: one point per step, each the mean of its own runs
    a = [(g["outcome"], g["trained_step"], g["runs"]) for g in groups if g["group_id"] == "dash-group-a"]
    assert a == [("trained", 1, 2), ("trained", 2, 2)]
    means = [g["mean_reward"] for g in groups if g["group_id"] == "dash-group-a"]
    assert means == pytest.approx([0.05, 0.25])
    assert by_id["dash-group-b"]["outcome"] == "waiting" and by_id["dash-group-b"]["runs"] == 2
    assert (
        by_id["dash-group-c"]["outcome"] == "skipped" and by_id["dash-group-c"]["reason"] == "zero_variance"
    )
    assert [g["at"] for g in groups] == sorted(g["at"] for g in groups)  # oldest first

    def runs(**q):  # noqa: ANN003, ANN202
        body = httpx.get(f"{proxy.url}/v1/admin/runs", params=q, headers=auth).json()
        return [r["id"] for r in body["data"]], body["total"]

    assert runs(status="trained")[1] == 4
    assert sorted(runs(min_reward=0.35, max_reward=0.6)[0]) == ["dash-run-4", "dash-run-5"]
    assert runs(q="run-3") == (["dash-run-3"], 1)
    assert runs(group_id="dash-group-c", split="train")[1] == 2
    first, total = runs(limit=25)
    second, _ = runs(limit=25, offset=25)
    assert total == 7 + 2 + BULK + 1 and len(first) == 25 and not set(first) & set(second)
    assert runs(until="2000-01-01T00:00:00Z") == ([], 0) and runs(since="2000-01-01T00:00:00Z")[1] == total
    bad = httpx.get(f"{proxy.url}/v1/admin/runs?since=yesterday", headers=auth)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "since"
    metrics = httpx.get(f"{proxy.url}/v1/training/metrics", headers=auth).json()
    assert metrics["policies"][0] == "dash-fork" and metrics["default_policy"] == "tiny"


def test_dashboard_in_chromium(proxy, browser_paths, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    with chromium(browser_paths, tmp_path / "chromium-profile") as driver:
        # `?key=` is not read: a key in the query string lands in every access log
        driver.get(f"{proxy.url}/?key={ADMIN_KEY}&refresh=0")
        WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "error").text)
        assert "admin key" in driver.find_element(By.ID, "error").text
        driver.get_log("browser")  # the 401s it got are logged as errors: read them away
        # the fragment is never sent to the server; the page keeps the key and drops it from the URL
        driver.get(f"{proxy.url}/?refresh=0#key={ADMIN_KEY}")
        loaded(driver)
        assert ADMIN_KEY not in driver.current_url

        # the trained policy is shown, not the newer (empty) fork; the picker offers both
        picker = Select(driver.find_element(By.ID, "policy"))
        assert picker.first_selected_option.text == "tiny"
        assert sorted(o.text for o in picker.options) == ["dash-fork", "tiny"]

        # the step chart: one point per GRPO step at its mean reward; the SFT step is a mark
        assert points(driver, "#chart circle.point") == [(float(s), m) for s, m in STEPS]
        marks = driver.find_elements(By.CSS_SELECTOR, "#chart line.mark")
        assert [m.get_attribute("data-x") for m in marks] == [str(SFT_STEP)]
        ys = [
            float(p.get_attribute("cy")) for p in driver.find_elements(By.CSS_SELECTOR, "#chart circle.point")
        ]
        assert ys == sorted(ys, reverse=True)  # rising reward = points going up the screen
        # SFT loss on its own chart, never on the GRPO loss axis
        assert points(driver, "#chart-sft_loss circle.point") == [(float(SFT_STEP), SFT_LOSS)]
        assert all(x != SFT_STEP for x, _ in points(driver, "#chart-loss circle.point"))

        # every rewarded group over time, the skipped one included and marked
        skipped = points(driver, "#groups-chart circle.point.skipped")
        trained = points(driver, "#groups-chart circle.point.trained")
        waiting = points(driver, "#groups-chart circle.point.waiting")
        assert [y for _, y in skipped] == [1.0] and [y for _, y in trained] == pytest.approx([0.05, 0.25])
        assert [round(y, 3) for _, y in waiting] == [0.45]
        assert "2 skipped" in driver.find_element(By.ID, "groups-note").text  # runs, as the card counts

        # runs per status, and dates in the times
        got = counts(driver)
        assert got["trained"] == 4 and got["completed"] == 2 and got["skipped"] == 2, got
        assert got["open"] == 2 + BULK, got
        created = driver.find_element(By.CSS_SELECTOR, "#runs tbody tr.run td:last-child").text
        assert str(datetime.now().year) in created, created
        shot(driver, "overview")

        # paging: 25 a page, then the rest
        rows = driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr.run")
        assert len(rows) == 25 and "1–25 of 34" in driver.find_element(By.ID, "page-info").text
        driver.find_element(By.ID, "next").click()
        WebDriverWait(driver, 30).until(lambda d: "26–34 of 34" in d.find_element(By.ID, "page-info").text)

        # a click on a count lists that status
        driver.find_element(By.CSS_SELECTOR, '#counts .count[data-status="completed"]').click()
        WebDriverWait(driver, 30).until(lambda d: "2 runs match" in d.find_element(By.ID, "runs-total").text)
        ids = [
            r.get_attribute("data-run-id")
            for r in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr.run")
        ]
        assert sorted(ids) == ["dash-run-4", "dash-run-5"]

        # filters: a reward range and a search by id
        driver.find_element(By.ID, "f-clear").click()
        driver.find_element(By.ID, "f-min").send_keys("0.15")
        driver.find_element(By.ID, "f-max").send_keys("0.35")
        driver.find_element(By.ID, "f-apply").click()
        WebDriverWait(driver, 30).until(lambda d: "2 runs match" in d.find_element(By.ID, "runs-total").text)
        ids = [
            r.get_attribute("data-run-id")
            for r in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr.run")
        ]
        assert sorted(ids) == ["dash-run-2", "dash-run-3"]
        shot(driver, "filtered")
        driver.find_element(By.ID, "f-clear").click()
        driver.find_element(By.ID, "f-q").send_keys("live")
        driver.find_element(By.ID, "f-apply").click()
        WebDriverWait(driver, 30).until(lambda d: "1 run match" in d.find_element(By.ID, "runs-total").text)

        # a run's page: every call with its details, then the trajectory
        driver.find_element(By.ID, "f-clear").click()
        driver.find_element(By.ID, "f-q").send_keys("dash-run-3")
        driver.find_element(By.ID, "f-apply").click()
        WebDriverWait(driver, 30).until(lambda d: "1 run match" in d.find_element(By.ID, "runs-total").text)
        driver.find_element(By.CSS_SELECTOR, '#runs tr.run[data-run-id="dash-run-3"]').click()
        WebDriverWait(driver, 30).until(lambda d: "run dash-run-3" in d.find_element(By.ID, "run-title").text)
        calls = driver.find_elements(By.CSS_SELECTOR, "#calls tbody tr.call-row")
        assert len(calls) == 2
        cells = [c.text for c in calls[1].find_elements(By.TAG_NAME, "td")]
        assert cells[:2] == ["1", "0"] and cells[3] == "chat.completions" and cells[5] == "stop", cells
        facts = driver.find_element(By.ID, "run-facts").text
        assert "digits_only" in facts and "dash-group-a" in facts and "trained" in facts
        trajectory = driver.find_element(By.ID, "trajectory").text
        assert "Pick a number between 1 and 10 (run 3)." in trajectory and "answer 3.1" in trajectory
        shot(driver, "run")
        driver.find_element(By.CSS_SELECTOR, "#run-page a.back").click()
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "overview").is_displayed())
        no_script_errors(driver)
