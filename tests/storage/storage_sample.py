"""The hand-filled sample database of the storage tests: what a short agent session and two
training steps leave behind (imported by conftest.py and the tests that check exact rows)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine


def run_sync(fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run a coroutine to completion on a private loop in another thread (safe from any context)."""
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(lambda: asyncio.run(fn())).result()


T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
SYS = {"role": "system", "content": "You are a weather agent."}
USER_PARIS = {"role": "user", "content": "What's the weather in Paris?"}


def tool_call(i: str, name: str, args: str) -> dict[str, Any]:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": args}}


def reply(content: str | None = None, tool_calls: list | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
    }


CALL_A = tool_call("call_a", "get_weather", '{"city": "Paris"}')
CALL_C1 = tool_call("call_c1", "search", '{"q": "Lyon"}')
CALL_C2 = tool_call("call_c2", "get_weather", '{"city": "Lyon"}')
CALL_E = tool_call("call_e", "get_weather", '{"city": "Rome"}')
PARTS = [{"type": "text", "text": "Describe"}, {"type": "text", "text": " this."}]

# run, group, status, reward, trained_step
SAMPLE_RUNS = [
    ("a", "g1", "trained", 1.0, 1),
    ("b", "g1", "trained", 0.0, 1),
    ("c", "g1", "trained", 0.5, 1),
    ("d", "g2", "completed", 1.0, None),
    ("e", "g2", "completed", 1.0, None),
    ("f", "g3", "open", None, None),
]
# run, seq, policy_step, request messages (or a prompt), response, status_code, error, prompt/compl. tokens
SAMPLE_COMPLETIONS: list[tuple] = [
    ("a", 0, 0, [SYS, USER_PARIS], reply(tool_calls=[CALL_A]), 200, None, 20, 10),
    (
        "a",
        1,
        0,
        [
            SYS,
            USER_PARIS,
            reply(tool_calls=[CALL_A])["choices"][0]["message"],
            {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "sunny"},
        ],
        reply("It is sunny in Paris."),
        200,
        None,
        40,
        5,
    ),
    ("b", 0, 0, [USER_PARIS], reply("I don't know."), 200, None, 20, 4),
    (
        "c",
        0,
        0,
        [{"role": "user", "content": "Weather in Lyon?"}],
        reply(tool_calls=[CALL_C1, CALL_C2]),
        200,
        None,
        20,
        12,
    ),
    (
        "c",
        1,
        0,
        [
            {"role": "user", "content": "Weather in Lyon?"},
            reply(tool_calls=[CALL_C1, CALL_C2])["choices"][0]["message"],
            {"role": "tool", "tool_call_id": "call_c1", "content": "Lyon is a city"},
            {"role": "tool", "tool_call_id": "call_c2", "content": "rain"},
        ],
        None,
        502,
        "upstream refused the connection",
        60,
        None,
    ),
    ("d", 0, 1, [{"role": "user", "content": PARTS}], reply("A picture."), 200, None, 10, 2),
    ("e", 0, 1, [{"role": "user", "content": "Rome?"}], reply(tool_calls=[CALL_E]), 200, None, 10, 3),
    ("f", 0, 2, "Once upon", {"choices": [{"index": 0, "text": " a time"}]}, 200, None, 3, 3),
    (None, None, 2, [{"role": "user", "content": "no run key"}], None, 504, "upstream timed out", 4, None),
]
SAMPLE_STEPS = [
    ("p", 1, "/ck/p/step-0001", 0.5, 0.12),
    ("p", 2, "/ck/p/step-0002", 0.75, 0.08),
    ("q", 1, None, 0.1, 0.3),
]


async def fill_sample(eng: AsyncEngine) -> None:
    """Insert the sample rows with plain INSERTs (no writer): what the views and queries must read."""
    from rlproxy.storage.models import Completion, Run, TrainingStep

    runs = [
        {
            "id": r,
            "group_id": g,
            "policy": "p",
            "status": s,
            "reward": rw,
            "trained_step": ts,
            "created_at": T0 + timedelta(minutes=i),
            "completed_at": None if rw is None else T0 + timedelta(minutes=i, seconds=30),
        }
        for i, (r, g, s, rw, ts) in enumerate(SAMPLE_RUNS)
    ]
    comps = []
    for i, (run, seq, step, msgs, resp, code, err, pt, ct) in enumerate(SAMPLE_COMPLETIONS):
        chat = isinstance(msgs, list)
        comps.append(
            {
                "run_id": run,
                "seq": seq,
                "policy": "p",
                "policy_step": step,
                "adapter": f"p@{step}" if step else "base",
                "endpoint": "chat.completions" if chat else "completions",
                "stream": False,
                "request": {"model": "p", "messages": msgs} if chat else {"model": "p", "prompt": msgs},
                "response": resp,
                "status": "ok" if code == 200 else "error",
                "status_code": code,
                "error": err,
                "prompt_tokens": pt,
                "completion_tokens": ct,
                "latency_ms": 12.5,
                "token_ids": [[1, 2]] if code == 200 else None,
                "created_at": T0 + timedelta(minutes=i, seconds=10),
            }
        )
    steps = [
        {
            "policy": p,
            "step": s,
            "adapter_path": path,
            "mean_reward": mr,
            "loss": loss,
            "started_at": T0 + timedelta(hours=s),
            "finished_at": T0 + timedelta(hours=s, minutes=5) + timedelta(seconds=n),
        }
        for n, (p, s, path, mr, loss) in enumerate(SAMPLE_STEPS)
    ]
    async with eng.begin() as conn:
        await conn.execute(insert(Run.__table__), runs)
        await conn.execute(insert(Completion.__table__), comps)
        await conn.execute(insert(TrainingStep.__table__), steps)
