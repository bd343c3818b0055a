"""The dashboard tells the truth and lets a person dig (issue 56 item 6; issue 55's `/rollouts` finding).

One real store: TrainerService trains the tiny model on a fixed prompt's group (step 1), later skips
the same prompt's next four runs (equal rewards), ungroups a lone run and leaves a pair waiting; val
runs of steps 0 and 1 answer the same prompts; a rollout's policy and reason hold HTML. A proxy on
that file serves the pages; headless Chromium reads them:

- the group chart counts runs as the status cards do (the fixed prompt is two points, trained and
  skipped, each the mean of its own runs), draws points without a line, and says so in its caption;
- a call's sampled tokens, coloured by logprob, decoded by the served tokenizer, beside its run's
  reward and group mean; two steps side by side on the same val prompts; filters in the URL survive
  a reload; an empty tool_calls list renders nothing;
- `/rollouts` sends the dashboard's headers and shows a policy name / reason holding markup as text.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from dashboard_browser import browser_paths, chromium, counts, loaded, no_script_errors, shot  # noqa: F401
from support import ServerlessBackend

ADMIN_KEY = "dig-admin"
XSS = '<img src=x onerror="window.__xss=1">'
TOKENS = [[17, 42, 99, 7]]  # the sampled ids of fixed-1-0's call, and their logprobs below
LOGPROBS = [[-0.01, -0.5, -2.0, -6.0]]
# val runs: (prompt ids, step that served it, reward); prompt [5, 6, 7] improves, [8, 9] stays
VAL = [([5, 6, 7], 0, 0.0), ([5, 6, 7], 0, 0.0), ([8, 9], 0, 1.0), ([5, 6, 7], 1, 1.0)]
VAL += [([5, 6, 7], 1, 0.5), ([8, 9], 1, 1.0), ([3, 4], 1, 0.25)]


async def _store(db_url: str, model_dir: Path, checkpoints: Path) -> None:
    from sqlalchemy import insert, text

    from rlproxy.storage import rollouts
    from rlproxy.storage.db import create_engine, upgrade_async
    from rlproxy.storage.models import Completion, Run
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.service import TrainerService

    await upgrade_async(db_url)
    engine = create_engine(db_url)
    svc = TrainerService(
        TrainerConfig(group_size=4, group_timeout=60, checkpoint_dir=str(checkpoints)),
        db_url,
        ServerlessBackend(model_dir),
    )
    past = datetime.now(UTC) - timedelta(hours=1)  # older than group_timeout: ready, or alone

    async def add(rid: str, group: str, reward: float, at: datetime, **run: Any) -> None:
        async with engine.begin() as conn:
            await conn.execute(
                insert(Run).values(
                    id=rid, group_id=group, policy="tiny", status=run.pop("status", "completed"),
                    reward=reward, created_at=at, completed_at=at, **run,
                )
            )  # fmt: skip
            message = {"role": "assistant", "content": f"answer of {rid}", "tool_calls": []}
            await conn.execute(
                insert(Completion).values(
                    run_id=rid, seq=0, policy="tiny", policy_step=0, status="ok",
                    endpoint="chat.completions", created_at=at - timedelta(seconds=1),
                    request={"messages": [{"role": "user", "content": f"prompt of {group}"}]},
                    response={"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]},
                    prompt_token_ids=[1, 2, 3], token_ids=TOKENS, logprobs=LOGPROBS,
                )
            )  # fmt: skip

    try:
        for i, reward in enumerate([0.0, 1.0, 0.0, 1.0]):  # the fixed prompt, first batch: trained
            await add(f"fixed-1-{i}", "fixed", reward, past)
        await add("alone-0", "alone", 0.5, past)  # alone past group_timeout: ungrouped
        assert (await svc.step_once())["step"] == 1
        for i in range(4):  # the same prompt later, every answer right: skipped, never a step
            await add(f"fixed-2-{i}", "fixed", 1.0, past + timedelta(minutes=1))
        for i, reward in enumerate([0.2, 0.8]):  # two of four: waiting for the rest of the group
            await add(f"pair-{i}", "pair", reward, datetime.now(UTC))
        assert await svc.step_once() is None
        async with engine.begin() as conn:
            for i, (ids, step, reward) in enumerate(VAL):
                rid = f"val-{i}"
                await conn.execute(
                    insert(Run).values(
                        id=rid, group_id=f"val-{step}-{ids}", policy="tiny", status="validated", split="val",
                        reward=reward, created_at=past, completed_at=past,
                    )
                )  # fmt: skip
                await conn.execute(
                    insert(Completion).values(
                        run_id=rid, seq=0, policy="tiny", policy_step=step, status="ok", created_at=past,
                        request={"messages": [{"role": "user", "content": f"val prompt {ids}"}]},
                        prompt_token_ids=ids, token_ids=[[1]], logprobs=[[-0.1]],
                    )
                )  # fmt: skip
        rid, _ = await rollouts.begin(engine, XSS, 1, 0.5)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE rollouts SET reason = :r WHERE id = :i"), {"r": XSS, "i": rid})
    finally:
        await svc.stop()
        await engine.dispose()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("dashboard-dig")
    db = tmp / "rlproxy.db"
    asyncio.run(_store(f"sqlite+aiosqlite:///{db}", tiny_model_dir, tmp / "checkpoints"))
    return db


@pytest.fixture
def proxy(store: Path, make_proxy: Any, tiny_model_dir: Path) -> Any:
    return make_proxy(
        "http://127.0.0.1:1",
        model=str(tiny_model_dir),
        backend=ServerlessBackend(tiny_model_dir),
        db_url=f"sqlite+aiosqlite:///{store}",
        admin_key=ADMIN_KEY,
    )


AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
CARDS = {"trained": "trained", "skipped": "skipped", "completed": "waiting", "ungrouped": "ungrouped"}


def test_group_chart_counts_are_the_status_cards(proxy: Any) -> None:
    """A prompt's runs trained at step 1 and its runs skipped later are two points, each its own mean;
    summed per outcome they are the status cards' counts (today's chart: one "trained" point of 8)."""
    stats = httpx.get(f"{proxy.url}/v1/runs/stats", headers=AUTH).json()["by_status"]
    assert {s: stats.get(s, 0) for s in CARDS} == {"trained": 4, "skipped": 4, "completed": 2, "ungrouped": 1}
    body = httpx.get(f"{proxy.url}/v1/training/groups", headers=AUTH).json()
    groups = body["data"]
    for status, outcome in CARDS.items():
        assert sum(g["runs"] for g in groups if g["outcome"] == outcome) == stats[status], status
        assert body["runs"][outcome] == stats[status], status
    fixed = {g["outcome"]: g for g in groups if g["group_id"] == "fixed"}
    assert set(fixed) == {"trained", "skipped"}
    assert fixed["trained"]["mean_reward"] == 0.5 and fixed["trained"]["trained_step"] == 1
    assert fixed["skipped"]["mean_reward"] == 1.0 and fixed["skipped"]["reason"] == "zero_variance"


def test_token_view_and_compare_routes(proxy: Any, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    run = httpx.get(f"{proxy.url}/v1/runs/fixed-1-1", headers=AUTH).json()
    cid = run["completions"][0]["id"]
    body = httpx.get(f"{proxy.url}/v1/admin/completions/{cid}/tokens", headers=AUTH).json()
    assert body["token_ids"] == TOKENS and body["logprobs"] == LOGPROBS
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert body["pieces"] == [[tok.decode([t]) for t in TOKENS[0]]]
    assert body["run"]["reward"] == 1.0 and body["run"]["trained_step"] == 1
    assert body["cohort"]["runs"] == 4 and body["cohort"]["mean_reward"] == 0.5  # its group at step 1
    assert httpx.get(f"{proxy.url}/v1/admin/completions/999999/tokens", headers=AUTH).status_code == 404
    assert httpx.get(f"{proxy.url}/v1/admin/completions/{cid}/tokens").status_code == 401

    cmp = httpx.get(f"{proxy.url}/v1/training/compare", headers=AUTH).json()  # default: the two newest
    assert [(a["policy"], a["step"], a["runs"]) for a in cmp["arms"]] == [("tiny", 1, 4), ("tiny", 0, 3)]
    assert (cmp["a"]["step"], cmp["b"]["step"]) == (0, 1)
    rows = [(p["prompt"], p["a_mean"], p["b_mean"], p["a_runs"], p["b_runs"]) for p in cmp["prompts"]]
    assert rows == [("val prompt [5, 6, 7]", 0.0, 0.75, 2, 2), ("val prompt [8, 9]", 1.0, 1.0, 1, 1)]
    assert cmp["a"]["mean_reward"] == 0.5 and cmp["b"]["mean_reward"] == 0.875  # over shared prompts
    swapped = httpx.get(f"{proxy.url}/v1/training/compare?a=tiny@1&b=tiny@0", headers=AUTH).json()
    assert [p["diff"] for p in swapped["prompts"]] == [-0.75, 0.0]
    bad = httpx.get(f"{proxy.url}/v1/training/compare?a=tiny", headers=AUTH)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "a"


def test_rollouts_page_headers(proxy: Any) -> None:
    """Issue 55: `/rollouts` had no CSP, framing or nosniff headers and an inline script."""
    page = httpx.get(f"{proxy.url}/rollouts")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "'unsafe" not in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
    assert "<script>" not in page.text and "<style" not in page.text  # the CSP would block them
    for name in ("rollouts.js", "dig.js", "app.js"):
        script = httpx.get(f"{proxy.url}/dashboard/{name}").text
        assert "innerHTML" not in script and "insertAdjacentHTML" not in script, name


def test_dig_in_chromium(proxy: Any, browser_paths, tmp_path: Path) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def wait(cond: Any) -> None:
        WebDriverWait(driver, 30).until(lambda d: cond())

    with chromium(browser_paths, tmp_path / "profile") as driver:
        driver.get(f"{proxy.url}/?refresh=0#key={ADMIN_KEY}")
        loaded(driver)
        # the group chart: run counts per outcome = the status cards; points, no line between groups
        cards = counts(driver)
        svg = driver.find_element(By.ID, "groups-chart")
        drawn = driver.execute_script("return JSON.parse(arguments[0].dataset.runs)", svg)
        for status, outcome in CARDS.items():
            assert drawn[outcome] == cards[status], (status, drawn, cards)
        assert not svg.find_elements(By.CSS_SELECTOR, "polyline")
        note = driver.find_element(By.ID, "groups-note").text
        assert "4 trained" in note and "4 skipped" in note and "1 ungrouped" in note, note
        assert len(svg.find_elements(By.CSS_SELECTOR, "circle.point")) == 4  # fixed x2, alone, pair
        shot(driver, "dig-overview")

        # filters live in the URL: a reload shows the same list
        driver.find_element(By.CSS_SELECTOR, '#counts .count[data-status="skipped"]').click()
        wait(lambda: "4 runs match" in driver.find_element(By.ID, "runs-total").text)
        assert "status=skipped" in driver.current_url
        driver.refresh()
        loaded(driver)
        wait(lambda: "4 runs match" in driver.find_element(By.ID, "runs-total").text)
        assert driver.find_element(By.ID, "f-status").get_attribute("value") == "skipped"

        # a run's page: no stray [] for an empty tool_calls list; a call's tokens coloured by logprob
        driver.get(f"{proxy.url}/?refresh=0#run=fixed-1-1")
        loaded(driver)
        assert "[]" not in driver.find_element(By.ID, "trajectory").text
        driver.find_element(By.CSS_SELECTOR, "#calls tr.call-row").click()
        wait(lambda: driver.find_elements(By.CSS_SELECTOR, "#tokens pre.tokens .tok"))
        toks = driver.find_elements(By.CSS_SELECTOR, "#tokens pre.tokens .tok")
        got = [(int(t.get_attribute("data-id")), t.get_attribute("class").split()[-1]) for t in toks]
        assert got == [(17, "lp0"), (42, "lp1"), (99, "lp2"), (7, "lp3")]
        cohort = driver.find_element(By.CSS_SELECTOR, "#tokens .cohort").text
        assert "reward 1.000" in cohort and "mean 0.500" in cohort and "not stored" in cohort, cohort
        shot(driver, "dig-tokens")

        # two steps on the same val prompts
        driver.get(f"{proxy.url}/?refresh=0#compare")
        loaded(driver)
        rows = driver.find_elements(By.CSS_SELECTOR, "#compare-table tbody tr")
        assert [r.find_elements(By.TAG_NAME, "td")[-1].text for r in rows] == ["+0.750", "+0.000"]
        assert driver.find_element(By.ID, "compare-chart").get_attribute("data-points") == "2"
        shot(driver, "dig-compare")
        no_script_errors(driver)

        # the rollouts page: a policy and a reason holding markup are text, never elements
        driver.get(f"{proxy.url}/rollouts#key={ADMIN_KEY}")
        wait(lambda: driver.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "true")
        cells = [td.text for td in driver.find_elements(By.CSS_SELECTOR, "#rows tbody td")]
        assert cells.count(XSS) == 2, cells
        assert not driver.find_elements(By.CSS_SELECTOR, "#rows img")
        assert driver.execute_script("return window.__xss") is None
        shot(driver, "dig-rollouts")
