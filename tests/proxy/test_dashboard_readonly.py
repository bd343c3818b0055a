"""`rlproxy dashboard --db`: the dashboard on a database, read-only, no model loaded — the real
program in a subprocess, the page in headless Chromium, the write routes absent."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cli_helpers import sample_db
from dashboard_browser import browser_paths, chromium, counts, loaded, no_script_errors, points  # noqa: F401
from proxy_helpers import free_port

RLPROXY = str(Path(sys.executable).parent / "rlproxy")
ADMIN_KEY = "ro-admin"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Dashboard:
    """`rlproxy dashboard` running until the test ends."""

    def __init__(self, db: Path, *extra: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [RLPROXY, "dashboard", "--db", str(db), "--port", str(self.port), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line or "read-only" in line:
                break
        assert line.strip() == f"rlproxy dashboard (read-only) on http://127.0.0.1:{self.port}/", line
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sample_db(tmp_path_factory.mktemp("dash-ro") / "sample.db")


@pytest.fixture(scope="module")
def dashboard(db: Path):
    before = _sha(db)
    server = Dashboard(db)
    yield server
    server.close()
    assert _sha(db) == before  # nothing was written


def test_no_model_no_writes(dashboard):
    maps = Path(f"/proc/{dashboard.proc.pid}/maps").read_text()
    assert "libtorch" not in maps  # no model, no torch in the process
    get = lambda path: httpx.get(f"{dashboard.url}{path}").status_code  # noqa: E731
    post = lambda path: httpx.post(f"{dashboard.url}{path}", json={"reward": 1.0}).status_code  # noqa: E731
    for path in ("/", "/dashboard/app.js", "/v1/runs", "/v1/runs/stats", "/v1/runs/a", "/v1/training/steps"):
        assert get(path) == 200, path
    assert httpx.get(f"{dashboard.url}/v1/training/metrics").json()["data"][-1]["mean_reward"] == 0.75
    assert httpx.get(f"{dashboard.url}/healthz").json() == {"status": "ok", "mode": "read-only"}
    for path in ("/v1/models", "/metrics", "/v1/admin/anything", "/docs"):
        assert get(path) == 404, path
    for path in (
        "/v1/runs/a/reward",
        "/v1/chat/completions",
        "/v1/completions",
        "/runs/x/v1/chat/completions",
    ):
        assert post(path) == 404, path
    assert post("/v1/runs") == 405 and post("/v1/training/steps") == 405
    assert httpx.delete(f"{dashboard.url}/v1/runs/a").status_code == 405
    assert get("/v1/runs/nosuch") == 404


def test_admin_key_guards_the_data(db):
    server = Dashboard(db, "--admin-key", ADMIN_KEY)
    try:
        assert httpx.get(f"{server.url}/").status_code == 200  # the page itself is public
        for path in ("/v1/runs", "/v1/runs/a", "/v1/training/steps"):
            assert httpx.get(f"{server.url}{path}").status_code == 401, path
            ok = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert ok.status_code == 200, path
    finally:
        server.close()


def test_page_renders_in_chromium(dashboard, browser_paths, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    with chromium(browser_paths, tmp_path / "chromium-profile", size="1280,1000") as driver:
        driver.get(f"{dashboard.url}/?refresh=0")
        loaded(driver)
        got = counts(driver)
        assert got["trained"] == 3 and got["completed"] == 2 and got["open"] == 1, got
        rows = driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr.run")
        ids = [r.get_attribute("data-run-id") for r in rows]
        assert ids == ["f", "e", "d", "c", "b", "a"]  # newest first
        # the sample's three steps, each a point at its mean reward (the chart shows one policy at a time)
        picker = Select(driver.find_element(By.ID, "policy"))
        got_points = []
        for name in [o.text for o in picker.options]:
            picker.select_by_visible_text(name)
            note = f"of {name}"
            WebDriverWait(driver, 30).until(
                lambda d, note=note: note in d.find_element(By.ID, "steps-note").text
            )
            got_points += points(driver, "#chart circle.point")
        assert sorted(got_points) == [(1.0, 0.1), (1.0, 0.5), (2.0, 0.75)]
        rows[ids.index("a")].click()
        WebDriverWait(driver, 30).until(
            lambda d: "It is sunny in Paris." in d.find_element(By.ID, "trajectory").text
        )
        assert "What's the weather in Paris?" in driver.find_element(By.ID, "trajectory").text
        no_script_errors(driver)
