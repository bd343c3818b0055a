"""Siblings of imported prompts (issue 58, "Use what was imported"): `rlproxy import --policy agent`
stores a team's past calls text-only, and `siblings=agent=imported` turns them into scored groups
that the trainer trains.

Real parts: chat.completion records made by a real `openai` client against the stub upstream
(stored-completions pairs, `{"request", "response"}`, one with tools), imported by the real
`rlproxy import`; then `build_app` (what `rlproxy serve` runs) on the embedded engine with the tiny
model, K = 2, a url scorer on loopback. Each group's prompt ids are what the engine's `/tokenize`
answers for the imported messages and tools, and what the tokenizer's own chat template renders;
the sampled ids and logprobs equal a direct seeded sample. Which calls `imported` offers (never a
captured, hosted or other policy's call; a backlog waits instead of being dropped; once each, a
restart included) is tested on the store alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support import rows, tiny_settings
from traces.traced import MESSAGES, TOOLS
from trainer.serving import serving
from trainer.test_siblings import _service, _settings, _store_calls, _wait
from trainer.test_siblings_tenancy import Recorder
from typer.testing import CliRunner

from rlproxy.cli.main import app
from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.inference.tools import messages_for_template
from rlproxy.storage import siblings as store
from rlproxy.storage.db import create_engine
from rlproxy.trainer import siblings as sib

COLOR = [{"role": "user", "content": "Name a color."}]


def _chat_records(stub: Any, path: Path, tag: str, bad: bool = False) -> list[dict[str, Any]]:
    """Stored-completions pairs of a real openai client's calls (the stub answers; each completion's
    id `chatcmpl-<tag>-<i>`, as OpenAI gives each its own), one a line; with `bad`, one more whose
    message has no role (the engine's chat template refuses it). Returns the requests sent."""
    client = openai.OpenAI(base_url=stub.url + "/v1", api_key="sk-test")
    requests: list[dict[str, Any]] = [
        {"model": "gpt-4o-mini", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, "temperature": 0.8},
        {"model": "gpt-4o-mini", "messages": COLOR, "max_tokens": 3},
    ]
    if bad:
        requests.append({"model": "gpt-4o-mini", "messages": [{"content": "no role"}], "max_tokens": 3})
    lines = []
    for i, r in enumerate(requests):
        sent = r if i < 2 else {**r, "messages": COLOR}  # the call was valid; its record lost the role
        response = {**client.chat.completions.create(**sent).model_dump(), "id": f"chatcmpl-{tag}-{i}"}
        lines.append({"request": r, "response": response})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return requests


def _import(path: Path, db: Path, *args: str) -> None:
    out = CliRunner().invoke(app, ["import", str(path), "--db", str(db), *args])
    assert out.exit_code == 0, out.output


async def test_imported_prompts_become_scored_groups_that_train(
    stub: Any, tiny_model_dir: Path, tiny_tokenizer: Any, tmp_path: Path
) -> None:
    db = tmp_path / "rlproxy.db"
    requests = _chat_records(stub, tmp_path / "chats.jsonl", "agent", bad=True)
    await asyncio.to_thread(_import, tmp_path / "chats.jsonl", db, "--policy", "agent")
    _chat_records(stub, tmp_path / "theirs.jsonl", "theirs")  # under their model's name: not agent's
    await asyncio.to_thread(_import, tmp_path / "theirs.jsonl", db)
    scorer = Recorder()
    settings = tiny_settings(
        tiny_model_dir,
        tmp_path,
        groups_per_step=1,
        poll_interval=0.1,
        siblings="agent=imported",
        siblings_k=2,
        siblings_max_share=1.0,
        scorer="url",
        scorer_url=scorer.url,
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1)
    async with scorer.serving(), serving(settings, backend) as _, httpx.AsyncClient(timeout=60) as http:
        auth = {"Authorization": f"Bearer {backend.api_key}"}
        groups = await _wait(
            db,
            "SELECT g.id, g.completion_id, g.policy, g.k, g.with_original, g.reason, g.status, g.error, "
            "c.request FROM sibling_groups g JOIN completions c ON c.id = g.completion_id "
            "ORDER BY g.completion_id",
            lambda g: len(g) == 3 and all(r[6] in ("scored", "failed") for r in g),
        )
        # the two good imports scored, K fresh answers each; the roleless one failed at /tokenize
        assert [r[2:7] for r in groups] == [
            ("agent", 2, 0, "imported", s) for s in ("scored",) * 2 + ("failed",)
        ]
        assert "/tokenize answered 400" in groups[2][7]
        for (gid, cid, *_, stored), want in zip(groups[:2], requests[:2], strict=True):
            imported = json.loads(stored)
            assert imported["messages"] == want["messages"] and imported.get("tools") == want.get("tools")
            tokenized = await http.post(
                f"{backend.base_url}/tokenize",
                headers=auth,
                json={
                    "model": backend.served_model,
                    "messages": want["messages"],
                    "tools": want.get("tools"),
                },
            )
            ids = tokenized.json()["tokens"]
            text = tiny_tokenizer.apply_chat_template(
                messages_for_template(want["messages"]),
                tools=want.get("tools"),
                add_generation_prompt=True,
                tokenize=False,
            )
            assert ids == tiny_tokenizer.encode(text, add_special_tokens=False)
            members = rows(
                db,
                "SELECT r.branch_of, r.reward_source, c.prompt_token_ids, c.token_ids, c.logprobs, c.request "
                f"FROM runs r JOIN completions c ON c.run_id = r.id WHERE r.group_id = '{gid}' ORDER BY r.id",
            )
            assert len(members) == 2 and all(m[0] == cid and m[1] == "sibling" for m in members)
            assert all(json.loads(m[2]) == ids for m in members)
            req = json.loads(members[0][5])
            assert req["prompt"] == ids and req["seed"] == sib.seed_of(cid)
            assert (req["max_tokens"], req["temperature"]) == (
                want["max_tokens"],
                want.get("temperature", 1.0),
            )
            again = await http.post(
                f"{backend.base_url}/v1/completions",
                headers=auth,
                json={**req, "n": 2, "return_token_ids": True},
            )
            choices = sorted(again.json()["choices"], key=lambda c: c["index"])
            for m, c in zip(members, choices, strict=True):
                assert json.loads(m[3]) == [c["token_ids"]] and len(c["token_ids"]) <= want["max_tokens"]
                assert json.loads(m[4])[0] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-4)

        # the scorer saw the imported conversation and its tools, and the two candidates
        by_group = {b["group_id"]: b for b in scorer.bodies}
        body = by_group[groups[0][0]]
        assert body["messages"] == MESSAGES and body["tools"] == TOOLS and len(body["candidates"]) == 2

        # the scored groups train agent (groups_per_step=1)
        await _wait(db, "SELECT step, policy FROM training_steps", lambda s: len(s) >= 1, timeout=180)
        assert rows(db, "SELECT DISTINCT policy FROM training_steps") == [("agent",)]
        trained = rows(db, "SELECT count(*) FROM runs WHERE status = 'trained' AND branch_of IS NOT NULL")
        assert trained[0][0] >= 2

        # the engine's /tokenize refuses what it cannot render with OpenAI's error body
        for bad in ({"messages": [{"content": "no role"}]}, {"messages": "hi"}, {}):
            r = await http.post(f"{backend.base_url}/tokenize", headers=auth, json=bad)
            assert r.status_code == 400, r.text
            assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    # the other import (policy gpt-4o-mini) was never offered
    assert rows(db, "SELECT count(*) FROM sibling_groups WHERE policy != 'agent'") == [(0,)]


async def test_imported_offers_each_imported_call_of_its_policy_once(stub: Any, tmp_path: Path) -> None:
    assert sib.parse_modes("agent=imported+new") == {"agent": frozenset({"imported", "new"})}
    settings = _settings(tmp_path, siblings_queue=2).model_copy(update={"siblings": "p=imported,hp=imported"})
    db = Path(settings.db_url.split("///")[1])
    await _store_calls(settings, 2)  # captured calls of p (ids): not imported
    await _store_calls(settings, 1, source="hosted")  # a hosted answer of p
    for tag, args in (
        ("hp", ["--policy", "hp"]),
        ("theirs", []),
        *((f"p{i}", ["--policy", "p"]) for i in range(3)),
    ):
        # a hosted policy's, their model's name (gpt-4o-mini), then p's: six calls
        await asyncio.to_thread(_chat_records, stub, tmp_path / f"{tag}.jsonl", tag)
        await asyncio.to_thread(_import, tmp_path / f"{tag}.jsonl", db, *args)
    svc = _service(settings, "http://127.0.0.1:9", hosted=frozenset({"hp"}))
    svc._engine = create_engine(settings.db_url)
    try:
        # p's six imported calls, two at a time (the queue's room): the rest wait, none dropped
        assert await svc.poll_once() == 2 and await svc.poll_once() == 0
        offered = list(svc.queue)
        while svc.queue:
            svc.queue.clear()
            assert await svc.poll_once() in (0, 2)
            offered += svc.queue
        assert svc.counts["dropped"] == 0
        assert len(offered) == 6 and len({c.completion_id for c in offered}) == 6
        assert {(c.policy, c.reason, tuple(c.prompt_ids)) for c in offered} == {("p", "imported", ())}
        sources = rows(
            db,
            f"SELECT DISTINCT source FROM completions WHERE id IN {tuple(c.completion_id for c in offered)}",
        )
        assert sources == [("import",)]
        # --policy names the policy; the model stays the call's adapter
        got = rows(db, "SELECT DISTINCT policy, adapter FROM completions WHERE source = 'import' ORDER BY 1")
        assert got == [("gpt-4o-mini", "gpt-4o-mini"), ("hp", "gpt-4o-mini"), ("p", "gpt-4o-mini")]
        # no limit in its request: DEFAULT_MAX_TOKENS, though the stub cut its answer (no sampled ids)
        no_limit = dataclasses.replace(offered[0], request={"messages": COLOR})
        assert offered[0].finish_reason == "length"
        assert sib.sampling_params(no_limit, None)["max_tokens"] == sib.DEFAULT_MAX_TOKENS
        assert await svc.poll_once() == 0  # read once: the cursor is past them
        for c in offered[:4]:  # branched (a failed group counts: never tried again)
            await store.fail_sampling(svc._engine, group_id=f"sib-{c.completion_id}", call=c, k=2, error="x")
    finally:
        await svc._engine.dispose()
    # a restart reads imported calls from the start again, and finds only the two not branched
    again = _service(settings, "http://127.0.0.1:9", hosted=frozenset({"hp"}))
    again._engine = create_engine(settings.db_url)
    try:
        assert await again.poll_once() == 2
        assert {c.completion_id for c in again.queue} == {c.completion_id for c in offered[4:]}
    finally:
        await again._engine.dispose()
