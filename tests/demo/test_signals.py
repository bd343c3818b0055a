"""`rlproxy demo --signal/--siblings/--shadow` (issue 54): the tasks' call-level checkers (exact
numbers: a candidate's score is the task's own reward part), the demo's url scorer under real uvicorn,
the unique-task generator and its fixed rungs, the options, the siblings tally read from SQL, and the
demo end to end (fast: the tiny model)."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from rlproxy.demo import directory, number_game, signals, store
from rlproxy.demo.checkers import directory_call, number_call, score_body
from rlproxy.demo.rungs import prompt_split
from rlproxy.demo.scorer import ScorerServer
from rlproxy.demo.tasks import UniqueTasks, first_prompt, rung_tasks
from rlproxy.trainer.resample import as_message

CALL = '<tool_call>\n{{"name": "lookup", "arguments": {{"name": "{name}"}}}}\n</tool_call>'
SCHEMA_CUT = '<tool_call>\n{"type": "function", "function": {"name": "lookup", "parameters": {"type": "obj'

# ------------------------------------------------------------------ number game: the checker per call


@pytest.mark.parametrize(
    ("first", "second"),
    [("7", "8"), (" 7\n", "8."), ("7", "9"), ("7", "The answer is 8"), ("I pick 7", "8"), ("I pick 7", "9"),
     ("seven", "8"), ("", ""), ("10", "11"), ("23", "24")],
)  # fmt: skip
def test_number_checker_calls_add_up_to_the_episode_reward(first: str, second: str) -> None:
    """Turn 1's candidate gets the digits-only part, turn 2's the correct part; together: the reward."""
    prompt = number_game.task_prompt(20, 30, "quiz")
    turn1 = number_call([{"role": "user", "content": prompt}], as_message(first, "stop"))
    conversation = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": first},
        {"role": "user", "content": number_game.SECOND_PROMPT},
    ]
    turn2 = number_call(conversation, as_message(second, "stop"))
    reward, metrics = number_game.score(first, second)
    assert turn1 == number_game.DIGITS_WEIGHT * metrics["digits_only"]
    assert turn2 == number_game.CORRECT_WEIGHT * metrics["correct"]
    assert round(turn1 + turn2, 6) == reward


def test_number_checker_exact_values() -> None:
    user = [{"role": "user", "content": number_game.FIRST_PROMPT}]
    assert number_call(user, as_message("7", "stop")) == 0.3
    assert number_call(user, as_message("I pick 7", "length")) == 0.0
    assert number_call(user, {"content": None, "tool_calls": None}) == 0.0
    after = [
        *user,
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": number_game.SECOND_PROMPT},
    ]
    assert [number_call(after, as_message(t, "stop")) for t in ("8", "9", "8.", "eight")] == [
        0.7,
        0.0,
        0.7,
        0.0,
    ]


# ------------------------------------------------------------------ directory: the checker per call


class ScriptedClient:
    """An OpenAI client stand-in that answers the agent's calls from a script (as the server parses
    them) and keeps the conversation each call was made with."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.seen = list(texts), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **body: Any) -> Any:
        self.seen.append(json.loads(json.dumps(body["messages"])))
        text = self.texts.pop(0) if self.texts else "I don't know"
        msg = as_message(text, "stop")
        calls = [
            SimpleNamespace(id=c["id"], function=SimpleNamespace(**c["function"]))
            for c in msg["tool_calls"] or []
        ]
        message = SimpleNamespace(content=msg["content"], tool_calls=calls or None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


@pytest.mark.parametrize(
    "texts",
    [
        [CALL.format(name="Alice"), CALL.format(name="Frank"), "Alice: 4821, Frank: 3307"],  # 1.0
        [CALL.format(name="Alice"), CALL.format(name="Frank"), "I don't know"],  # 0.3
        [CALL.format(name="Alice"), "Alice is 4821", CALL.format(name="Frank"), "4821"],  # 0.65
        [SCHEMA_CUT, SCHEMA_CUT, SCHEMA_CUT, SCHEMA_CUT, SCHEMA_CUT],  # the plateau: 0.1
        [SCHEMA_CUT, "hello", "hello", "hello", "hello"],  # an earlier call's try still counts: 0.1
        ["hello", "hello", "hello", "hello", "4821 and 3307"],  # 0.7
        [CALL.format(name="Bob"), CALL.format(name="Alice"), CALL.format(name="Zed"), "3307"],  # 0.55
    ],
)
def test_directory_checker_on_the_last_call_is_the_episode_reward(texts: list[str]) -> None:
    """The agent's own loop makes the conversation; the checker on each call is the reward the episode
    would have had ending there, and on the last call exactly the episode's reward."""
    client = ScriptedClient(texts)
    episode = directory.play_episode(client, "m", "g", ("Alice", "Frank"), topic="budget")  # type: ignore[arg-type]
    replies = texts[: episode.calls]
    scores = [
        directory_call(seen, as_message(t, "stop")) for seen, t in zip(client.seen, replies, strict=True)
    ]
    assert scores[-1] == episode.reward
    assert all(0.0 <= s <= directory.MAX_REWARD for s in scores)


def test_directory_checker_exact_values() -> None:
    conv = [{"role": "system", "content": directory.SYSTEM},
            {"role": "user", "content": directory.question(("Alice", "Frank"), "budget")}]  # fmt: skip
    one = directory.CALL_WEIGHT + directory.ATTEMPT_WEIGHT  # a well-formed lookup of a person asked for
    assert directory_call(conv, as_message(CALL.format(name="Alice"), "stop")) == one
    assert directory_call(conv, as_message(CALL.format(name="Bob"), "stop")) == directory.ATTEMPT_WEIGHT
    assert directory_call(conv, as_message(SCHEMA_CUT, "length")) == directory.ATTEMPT_WEIGHT
    assert directory_call(conv, as_message("Alice: 4821", "stop")) == directory.ANSWER_WEIGHT
    assert directory_call(conv, as_message("hello", "stop")) == 0.0
    assert (
        directory_call([{"role": "user", "content": "hi"}], as_message("4821", "stop")) == 0.0
    )  # no question


# ------------------------------------------------------------------ the demo's url scorer (real HTTP)


def test_scorer_endpoint_answers_the_wire_format() -> None:
    server = ScorerServer("number", api_key="sk-score")
    server.start()
    try:
        conv = [{"role": "user", "content": number_game.FIRST_PROMPT}]
        body = {"group_id": "sg-1", "policy": "p", "endpoint": "/v1/chat/completions", "messages": conv,
                "tools": None, "response_format": None, "max_tokens": 8,
                "candidates": [{"index": i, "content": c, "tool_calls": None, "finish_reason": "stop"}
                               for i, c in enumerate(["7", "I pick 7", None, " 4\n"])]}  # fmt: skip
        auth = {"Authorization": "Bearer sk-score"}
        r = httpx.post(server.score_url, json=body, headers=auth, timeout=10)
        assert r.status_code == 200 and r.json() == {"scores": [0.3, 0.0, 0.0, 0.3]}
        assert score_body("number", body) == [0.3, 0.0, 0.0, 0.3]
        assert httpx.post(server.score_url, json=body, timeout=10).status_code == 401
        bad = httpx.post(server.score_url, content=b"{not json", headers=auth, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        missing = httpx.post(server.score_url, json={**body, "candidates": []}, headers=auth, timeout=10)
        assert missing.status_code == 400 and "candidates" in missing.json()["error"]["message"]
        assert server.scorer.stats() == {"calls": 1, "candidates": 4, "errors": 3}
    finally:
        server.stop()


def test_the_proxys_url_scorer_reads_the_demos_scores() -> None:
    """The other side of the wire: rlproxy's own url scorer (trainer/scorers.py) posting to the demo's."""
    import asyncio

    from rlproxy.settings import Settings
    from rlproxy.trainer.scorers import ScoreRequest, build_scorer

    server = ScorerServer("directory")
    server.start()
    try:
        settings = Settings(scorer="url", scorer_url=server.score_url)

        async def score() -> list[float] | None:
            async with httpx.AsyncClient() as client:
                scorer = build_scorer(settings, client)
                if scorer.name != "url":
                    return None
                conv = [{"role": "system", "content": directory.SYSTEM},
                        {"role": "user", "content": directory.question(("Alice", "Frank"))}]  # fmt: skip
                texts = [CALL.format(name="Alice"), SCHEMA_CUT, "no idea"]
                candidates = [as_message(t, "stop") for t in texts]
                request = {"messages": conv, "tools": directory.TOOLS, "max_tokens": 32}
                return await scorer.score(
                    ScoreRequest("sg-1", "p", "/v1/chat/completions", request, candidates)
                )

        scores = asyncio.run(score())
        if scores is None:
            pytest.skip("trainer/scorers.py has no url scorer on this branch yet")
        assert scores == [0.2, 0.1, 0.0] and server.scorer.stats()["calls"] == 1
    finally:
        server.stop()


# ------------------------------------------------------------------ unique tasks and fixed rungs


@pytest.mark.parametrize("task", ["number", "directory"])
def test_unique_tasks_are_distinct_and_never_a_rung(task: str) -> None:
    rungs = rung_tasks(task, 3, 16)
    assert rungs == rung_tasks(task, 3, 16) and len({first_prompt(task, t) for t in rungs}) == 16
    assert rungs != rung_tasks(task, 4, 16)
    tasks = UniqueTasks(task, 3, rungs)
    drawn = [first_prompt(task, tasks.next()) for _ in range(4000)]  # past every directory combination
    assert len(set(drawn)) == len(drawn)
    assert not set(drawn) & {first_prompt(task, t) for t in rungs}
    assert drawn[:50] == [
        first_prompt(task, t) for t in (lambda u: [u.next() for _ in range(50)])(UniqueTasks(task, 3, rungs))
    ]


def test_directory_rungs_are_todays_and_their_pairs_are_held_out() -> None:
    rungs = rung_tasks("directory", 0, 16)
    assert [t["people"] for t in rungs] == prompt_split(0, 0, 16, 0)[1]
    assert all("topic" not in t for t in rungs)  # the rungs ask today's question
    tasks = UniqueTasks("directory", 0, rungs)
    held = {t["people"] for t in rungs}
    for _ in range(500):
        spec = tasks.next()
        assert spec["people"] not in held
        assert directory._ASKED.search(first_prompt("directory", spec)).groups() == spec["people"]  # type: ignore[union-attr]


# ------------------------------------------------------------------ options


def test_resolve_fills_in_the_signal_settings() -> None:
    legacy = signals.resolve("number")
    assert legacy.legacy and legacy.rung_minutes is None and legacy.serve_settings(None, 8) == {}
    scorer = signals.resolve("number", "scorer")
    assert (scorer.siblings, scorer.scorer, scorer.rung_minutes, scorer.rung_goal) == ("new", "url", 2.0, 0.3)
    assert scorer.serve_settings("http://127.0.0.1:9/score", 8) == {
        "group_timeout": 5.0, "groups_per_step": 4, "siblings": "new", "scorer": "url",
        "scorer_url": "http://127.0.0.1:9/score",
    }  # fmt: skip
    single = signals.resolve("directory", "singletons", rung_minutes=1.5)
    assert single.serve_settings(None, 8) == {
        "singletons": "train",
        "singleton_batch": 8,
        "group_timeout": 5.0,
    }
    assert (single.rung_minutes, single.rung_goal, single.scorer) == (1.5, 0.2, None)
    plateau = signals.resolve("directory", siblings="plateau", shadow=8)
    assert not plateau.legacy and plateau.signal is None
    assert plateau.serve_settings("http://s/score", 8) == {
        "siblings": "plateau", "shadow_prompts": 8, "scorer": "url", "scorer_url": "http://s/score"
    }  # fmt: skip
    assert (
        signals.resolve("directory", siblings="plateau", scorer="checks").serve_settings("u", 8)["scorer"]
        == "checks"
    )
    assert signals.resolve("directory", siblings="plateau", max_steps=20).max_steps == 20
    for bad in ({"signal": "scorer", "siblings": "off"}, {"scorer": "checks"}, {"signal": "judge"},
                {"max_steps": 20}, {"siblings": "plateau", "max_steps": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            signals.resolve("number", **bad)  # type: ignore[arg-type]


def test_demo_options_reach_run_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlproxy.cli.main import app
    from rlproxy.demo import run

    got: dict[str, Any] = {}
    monkeypatch.setattr(run, "run_demo", lambda **kw: got.update(kw) or {"signal": {"rung_goal": 0.3}})
    runner = CliRunner()
    result = runner.invoke(
        app, ["demo", "--signal", "scorer", "--shadow", "8", "--fast", "--rung-minutes", "1"]
    )
    assert result.exit_code == 0, result.output
    assert (got["signal_mode"], got["shadow"], got["siblings"], got["scorer"], got["rung_minutes"]) == (
        "scorer", 8, None, None, 1.0)  # fmt: skip
    got.clear()
    assert (
        runner.invoke(app, ["demo", "--task", "directory", "--seed", "4", "--siblings", "plateau"]).exit_code
        == 0
    )
    assert (got["siblings"], got["seed"], got["signal_mode"]) == ("plateau", 4, None)
    assert got["max_steps"] is None
    assert runner.invoke(app, ["demo", "--siblings", "plateau", "--max-steps", "20"]).exit_code == 0
    assert got["max_steps"] == 20
    assert runner.invoke(app, ["demo", "--signal", "nope"]).exit_code == 2
    refused = runner.invoke(app, ["demo", "--task", "directory", "--teacher", "--signal", "scorer"])
    assert refused.exit_code != 0 and "--teacher" in refused.output


def test_run_demo_refuses_a_mix_before_starting_anything(tmp_path: Path) -> None:
    from rlproxy.demo.run import run_demo

    with pytest.raises(ValueError, match="canary"):
        run_demo(1, out_dir=tmp_path, signal_mode="scorer", rollout="canary", echo=lambda _: None)
    with pytest.raises(ValueError, match="no signal"):
        run_demo(1, out_dir=tmp_path, signal_mode="scorer", siblings="off", echo=lambda _: None)
    assert not (tmp_path / "serve.log").exists()


# ------------------------------------------------------------------ the siblings tally, from SQL


def test_siblings_summary_reads_the_store(tmp_path: Path) -> None:
    from rlproxy.storage import db as dbm

    path = tmp_path / "rlproxy.db"
    dbm.upgrade(f"sqlite+aiosqlite:///{path}")
    now = "2026-12-07 10:00:00"
    runs = [  # id, group, status, reason, step, branch_of, split
        ("a1", "A", "skipped", "zero_variance", None, None, "train"),  # a plateau ...
        ("a2", "A", "skipped", "zero_variance", None, None, "train"),
        ("b1", "B", "trained", None, 1, None, "train"),
        ("b2", "B", "trained", None, 1, None, "train"),
        ("c1", "C", "skipped", "zero_variance", None, None, "train"),  # ... not rescued
        ("v1", "V", "validated", None, None, None, "val"),  # a rung: not an app group
        ("s1", "sg1", "trained", None, 2, 11, "train"),  # ... rescued by sg1
        ("s2", "sg1", "trained", None, 2, 11, "train"),
        ("t1", "sg3", "skipped", "zero_variance", None, 12, "train"),
        ("t2", "sg3", "skipped", "zero_variance", None, 12, "train"),
    ]
    groups = [("sg1", 11, "a1", "plateau", "scored"), ("sg2", 13, "c1", "plateau", "failed"),
              ("sg3", 12, "b1", "new", "scored"), ("sg4", 14, "b2", "new", "scoring")]  # fmt: skip
    with sqlite3.connect(path) as con:
        con.executemany(
            "INSERT INTO runs (id, group_id, status, status_reason, trained_step, branch_of, split, "
            "created_at, next_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
            [(*r, now) for r in runs],
        )
        con.executemany(
            "INSERT INTO sibling_groups (id, completion_id, run_id, policy, k, with_original, reason, "
            "status, attempts, created_at) VALUES (?, ?, ?, 'p', 4, 1, ?, ?, 0, ?)",
            [(*g, now) for g in groups],
        )
    tally = store.siblings_summary(path)
    assert tally["sibling_groups"] == {"made": 4, "scored": 2, "failed": 1, "trained": 1, "skipped": 1}
    assert tally["by_reason"]["plateau"] == {"made": 2, "scored": 1, "failed": 1, "trained": 1, "skipped": 0}
    assert tally["app_groups"] == {"trained": 1, "skipped_zero_variance": 2, "rescued_by_siblings": 1}
    states = {g["id"]: g for g in store.sibling_states(path, ["a1", "c1", "b1", "b2"])}
    assert {k: (g["done"], g["step"]) for k, g in states.items()} == {
        "sg1": (True, 2), "sg2": (True, None), "sg3": (True, None), "sg4": (False, None)
    }  # fmt: skip
    assert store.run_states(path, ["a1", "b1", "nope"]) == {"a1": ("skipped", None), "b1": ("trained", 1)}
    assert store.siblings_summary(tmp_path / "none.db")["sibling_groups"]["made"] == 0


# ------------------------------------------------------------------ end to end (fast: the tiny model)


def _fast(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> dict[str, Any]:
    from rlproxy.demo.run import run_demo

    monkeypatch.setenv("RLPROXY_CACHE_DIR", str(cache_dir))
    lines: list[str] = []
    summary = run_demo(5, fast=True, out_dir=tmp_path / "out", echo=lines.append, eval_episodes=4, **kw)
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert [r["rung"] for r in summary["rungs"]][0] == "base" and summary["rungs"][-1]["rung"] == "rl"
    assert all(r["episodes"] == 4 and 0.0 <= r["mean_reward"] <= 1.0 for r in summary["rungs"])
    assert any(line.startswith("sibling groups: ") for line in lines)
    return summary


@pytest.mark.timeout(600)
def test_fast_singletons_demo(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = _fast(tmp_path, cache_dir, monkeypatch, signal_mode="singletons")
    assert summary["groups"] == 3 and summary["signal"]["signal"] == "singletons"
    assert summary["settings_changed"]["singletons"]["value"] == "train"
    with sqlite3.connect(summary["db"]) as con:
        firsts = con.execute(
            "SELECT r.id, count(DISTINCT r.group_id), count(r.reward) FROM runs r WHERE r.split = 'train'"
        ).fetchone()
    assert firsts[1] == 12 and firsts[2] == 12  # 12 episodes, each its own task (group), each rewarded


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    importlib.util.find_spec("rlproxy.trainer.siblings") is None,
    reason="the siblings service (rlproxy/trainer/siblings.py, issue 54) is not on this branch yet",
)
def test_fast_scorer_demo(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No app reward at all: the runs stay unrewarded, every trained sample is a scored sibling."""
    summary = _fast(tmp_path, cache_dir, monkeypatch, signal_mode="scorer")
    assert summary["settings_changed"]["scorer"]["value"] == "url"
    assert summary["scorer"]["calls"] > 0 and summary["scorer"]["errors"] == 0
    assert summary["siblings"]["sibling_groups"]["scored"] > 0
    with sqlite3.connect(summary["db"]) as con:
        app_rewards = con.execute("SELECT count(reward) FROM runs WHERE branch_of IS NULL").fetchone()[0]
        sibling_sources = con.execute(
            "SELECT DISTINCT reward_source FROM runs WHERE reward IS NOT NULL"
        ).fetchall()
    assert app_rewards == 0 and sibling_sources == [("sibling",)]
