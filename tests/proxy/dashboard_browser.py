"""The dashboard tests' one browser helper: headless Chromium (or why not), the page loaded, chart
points read back, and screenshots when asked for.

`browser_paths` is the fixture (import it into a test module); `chromium(paths, profile_dir)` opens a
driver; `loaded(driver)` waits for the page (or its error line); `points(driver, css)` reads the
(x, y) of each `circle.point` a chart drew (chart.js writes them as data-x / data-y); `shot(driver,
name)` saves a PNG under `$RLPROXY_DASHBOARD_SHOTS` when that is set (nothing otherwise).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


@pytest.fixture(scope="module")
def browser_paths() -> tuple[str, str]:
    """(chromium, chromedriver), or a skip saying what to install (a failure in CI)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        if os.environ.get("CI") == "true":
            pytest.fail("CI needs chromium + chromedriver (apt-get install chromium chromium-driver)")
        pytest.skip("chromium/chromedriver not installed (Debian: apt-get install chromium chromium-driver)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("selenium is required in CI (it is in the dev extra)")
        pytest.skip("selenium not installed (pip install selenium)")
    return browser, driver


@contextmanager
def chromium(paths: tuple[str, str], profile: Path, size: str = "1280,1400") -> Any:
    """A headless Chromium driver (quit at the end)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = paths
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (*CHROMIUM_FLAGS, f"--window-size={size}", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def loaded(driver: Any, timeout: float = 60) -> None:
    """Wait until the page says it loaded (body[data-loaded]) or shows an error; fail on an error."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(
        lambda d: (
            d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "true"
            or d.find_element(By.ID, "error").text
        )
    )
    assert driver.find_element(By.ID, "error").text == ""


def points(driver: Any, css: str) -> list[tuple[float, float]]:
    """(x, y) of every point a chart drew, in drawing order: `css` selects the circles."""
    from selenium.webdriver.common.by import By

    return [
        (float(p.get_attribute("data-x")), float(p.get_attribute("data-y")))
        for p in driver.find_elements(By.CSS_SELECTOR, css)
    ]


def counts(driver: Any) -> dict[str, int]:
    """The runs-per-status counters."""
    from selenium.webdriver.common.by import By

    return {
        c.get_attribute("data-status"): int(c.find_element(By.TAG_NAME, "b").text)
        for c in driver.find_elements(By.CSS_SELECTOR, "#counts .count")
    }


def no_script_errors(driver: Any) -> None:
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors


def shot(driver: Any, name: str) -> None:
    """Save the whole page as `$RLPROXY_DASHBOARD_SHOTS/{name}.png` when that variable is set."""
    folder = os.environ.get("RLPROXY_DASHBOARD_SHOTS")
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(900, min(int(height) + 40, 4000)))
    driver.save_screenshot(str(Path(folder) / f"{name}.png"))
