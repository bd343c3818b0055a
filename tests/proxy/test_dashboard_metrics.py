"""The dashboard's learning charts in headless Chromium, drawn from three real training steps.

The steps are real: TrainerService trains the tiny model on rewarded runs in a SQLite file (one
zero-variance group skipped on the way), and commits the per-step metric columns. A proxy on that
file serves the page; every chart must show one point per step at exactly the column's value.
"""

from __future__ import annotations

import asyncio
import math
import random
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from dashboard_browser import browser_paths, chromium, loaded, no_script_errors, points  # noqa: F401
from support import ServerlessBackend

ADMIN_KEY = "metrics-admin"
# (group, rewards) added before each step; "flat" has equal rewards: skipped, counted in step 2
ROUNDS: list[list[tuple[str, list[float]]]] = [
    [("g1", [0.0, 0.0, 1.0, 0.0])],
    [("flat", [1.0, 1.0, 1.0, 1.0]), ("g2", [0.0, 1.0, 1.0, 0.0])],
    [("g3", [1.0, 1.0, 1.0, 0.0])],
]
CHARTS = {  # chart id -> the columns it plots, in series order
    "zero_variance_frac": ["zero_variance_frac"],
    "kl": ["kl"],
    "clip": ["clip_frac_low", "clip_frac_high"],
    "entropy": ["entropy"],
    "completion_len_mean": ["completion_len_mean"],
    "policy_lag_mean": ["policy_lag_mean"],
    "tokens_per_s": ["tokens_per_s"],
    "grad_norm": ["grad_norm"],
    "loss": ["loss"],
}


async def _train(db_url: str, model_dir: Path, checkpoints: Path) -> None:
    """Three real steps of the tiny model; stored logprobs of 0 make some tokens clip."""
    from sqlalchemy import insert

    from rlproxy.storage.db import create_engine, upgrade_async
    from rlproxy.storage.models import Completion, Run
    from rlproxy.storage.training import commit_step
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.service import TrainerService

    await upgrade_async(db_url)
    engine = create_engine(db_url)
    rng = random.Random(7)
    config = TrainerConfig(group_size=4, learning_rate=1e-3, checkpoint_dir=str(checkpoints))
    svc = TrainerService(config, db_url, ServerlessBackend(model_dir))
    try:
        for n, groups in enumerate(ROUNDS, start=1):
            async with engine.begin() as conn:
                for gid, rewards in groups:
                    for i, reward in enumerate(rewards):
                        rid = f"{gid}-{i}"
                        now = datetime.now(UTC)
                        await conn.execute(
                            insert(Run).values(
                                id=rid, group_id=gid, policy="tiny", status="completed", reward=reward,
                                created_at=now, completed_at=now,
                            )
                        )  # fmt: skip
                        tokens = [rng.randrange(3, 1200) for _ in range(rng.randint(2, 8))]
                        await conn.execute(
                            insert(Completion).values(
                                run_id=rid, seq=0, policy="tiny", policy_step=n - 1, status="ok",
                                created_at=now,  # a run trains only completions from before its reward
                                prompt_token_ids=[rng.randrange(3, 1200) for _ in range(6)],
                                token_ids=[tokens], logprobs=[[0.0] * len(tokens)],
                            )
                        )  # fmt: skip
            result = await svc.step_once()
            assert result is not None and result["step"] == n
        # another policy's step, older than tiny's: the page shows tiny first and offers a picker
        old = datetime(2026, 1, 1, tzinfo=UTC)
        await commit_step(
            engine, policy="other", step=1, run_ids=[], adapter_path=None, finished_at=old, mean_reward=0.125,
            loss=0.5, columns={"kl": 0.25, "clip_frac_low": 0.0, "clip_frac_high": 0.5},
        )  # fmt: skip
    finally:
        await svc.stop()
        await engine.dispose()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("dashboard-metrics")
    db = tmp / "rlproxy.db"
    asyncio.run(_train(f"sqlite+aiosqlite:///{db}", tiny_model_dir, tmp / "checkpoints"))
    return db


def _columns(db: Path) -> list[dict[str, Any]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    try:
        sql = "SELECT * FROM training_steps WHERE policy = 'tiny' ORDER BY step"
        return [dict(r) for r in con.execute(sql)]
    finally:
        con.close()


def test_metrics_route_and_charts(
    trained: Path,
    make_proxy: Any,
    tiny_model_dir: Path,
    browser_paths,  # noqa: F811
    tmp_path,
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    rows = _columns(trained)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["zero_variance_frac"] for r in rows] == [0.0, 0.5, 0.0]  # the flat group, skipped before step 2
    for r in rows:
        for col in {c for cols in CHARTS.values() for c in cols} | {"reward_std", "mean_reward"}:
            assert r[col] is not None and math.isfinite(r[col]), (r["step"], col)

    proxy = make_proxy(
        "http://127.0.0.1:1",
        model=str(tiny_model_dir),
        backend=ServerlessBackend(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{trained}",
        admin_key=ADMIN_KEY,
    )
    # the data route: operators only, oldest step first, the columns exactly as stored
    assert httpx.get(f"{proxy.url}/v1/training/metrics").status_code == 401
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = httpx.get(f"{proxy.url}/v1/training/metrics", headers=auth).json()
    assert body["policies"] == ["tiny", "other"]  # newest step's policy first
    got = [(s["policy"], s["step"]) for s in body["data"]]
    assert got == [("other", 1), ("tiny", 1), ("tiny", 2), ("tiny", 3)]  # oldest first
    assert [s["kl"] for s in body["data"][1:]] == [r["kl"] for r in rows]
    only = httpx.get(f"{proxy.url}/v1/training/metrics?policy=other", headers=auth).json()
    assert [s["kl"] for s in only["data"]] == [0.25] and only["policies"] == ["other"]
    assert httpx.get(f"{proxy.url}/v1/training/metrics?limit=0", headers=auth).status_code == 422

    with chromium(browser_paths, tmp_path / "profile") as driver:
        driver.get(f"{proxy.url}/?refresh=0#key={ADMIN_KEY}")
        loaded(driver)

        # mean reward with its ± std band
        assert points(driver, "#chart circle.point") == [(float(r["step"]), r["mean_reward"]) for r in rows]
        assert driver.find_element(By.CSS_SELECTOR, "#chart path.band").get_attribute("d").startswith("M")

        # every learning chart: one point per step and series, at the stored value
        for chart, cols in CHARTS.items():
            svg = driver.find_element(By.ID, f"chart-{chart}")
            assert svg.get_attribute("data-points") == str(3 * len(cols)), chart
            circles = svg.find_elements(By.CSS_SELECTOR, "circle.point")
            for i, col in enumerate(cols):
                mine = [c for c in circles if f"s{i}" in c.get_attribute("class").split()]
                got = [(float(c.get_attribute("data-x")), float(c.get_attribute("data-y"))) for c in mine]
                assert got == [(float(r["step"]), pytest.approx(r[col], rel=1e-9)) for r in rows], (
                    chart,
                    col,
                )
            assert svg.find_elements(By.CSS_SELECTOR, "polyline.line"), chart
        legend = driver.find_element(By.ID, "chart-clip").find_elements(By.CSS_SELECTOR, ".legend text")
        assert [t.text for t in legend] == ["low", "high"]
        assert "3 steps of tiny" in driver.find_element(By.ID, "steps-note").text

        # the policy picker: the other policy's one step, on every chart
        picker = Select(driver.find_element(By.ID, "policy"))
        assert (
            picker.first_selected_option.text == "tiny"
            and driver.find_element(By.ID, "policy").is_displayed()
        )
        picker.select_by_visible_text("other")
        WebDriverWait(driver, 30).until(
            lambda d: "1 steps of other" in d.find_element(By.ID, "steps-note").text
        )
        kl = driver.find_elements(By.CSS_SELECTOR, "#chart-kl circle.point")
        assert [(c.get_attribute("data-x"), c.get_attribute("data-y")) for c in kl] == [("1", "0.25")]
        assert (
            driver.find_element(By.ID, "chart-entropy").get_attribute("data-points") == "0"
        )  # NULL: no point

        no_script_errors(driver)
