"""Batched /v1/completions: each choice is stored and trained with its own prompt (issue 16, bug 1).

Both backends answer `prompt: ["A B", "C D E"]` with one `prompt_token_ids` per choice; capture kept
only the first choice's, so every sample trained on `[10, 11]`. The capture functions the proxy
runs (`from_response`, `StreamAssembler`) feed the database, and the trainer reads it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from oracle import build_samples
from sqlalchemy.ext.asyncio import AsyncEngine
from transformers import AutoTokenizer

from rlproxy.proxy.capture import Captured, StreamAssembler, from_response, inject
from rlproxy.storage.records import Endpoint
from rlproxy.storage.training import load_runs

COMPLETIONS = Endpoint.COMPLETIONS

PROMPTS = [[10, 11], [12, 13, 14]]


def response() -> dict:
    """vLLM's and the embedded engine's non-streaming shape for two prompts, n = 1."""
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {
                "index": i,
                "text": "x",
                "prompt_token_ids": PROMPTS[i],
                "token_ids": [20 + i, 30 + i],
                "logprobs": {"token_logprobs": [-0.5, -0.25], "tokens": ["a", "b"]},
                "finish_reason": "stop",
            }
            for i in range(2)
        ],
    }


def chunks() -> list[dict]:
    """The same as a stream: a choice's first chunk carries its prompt ids, choices interleaved."""
    out = []
    for t in range(2):
        for i in range(2):
            c: dict[str, Any] = {
                "index": i,
                "text": "x",
                "token_ids": [(20, 30)[t] + i],
                "logprobs": {"token_logprobs": [(-0.5, -0.25)[t]], "tokens": ["a"]},
                "finish_reason": "stop" if t else None,
            }
            if t == 0:
                c["prompt_token_ids"] = PROMPTS[i]
            out.append({"id": "cmpl-1", "object": "text_completion", "choices": [c]})
    return out


def captured(stream: bool) -> Captured:
    inj = inject({"prompt": ["A B", "C D E"]}, COMPLETIONS)
    if not stream:
        return from_response(response(), COMPLETIONS, inj)
    asm = StreamAssembler(COMPLETIONS, inj)
    for chunk in chunks():
        asm.feed(chunk)
    return asm.result()


@pytest.mark.parametrize("stream", [False, True])
async def test_each_choice_trains_on_its_own_prompt(
    engine: AsyncEngine, add_run: Any, tiny_model_dir: Path, stream: bool
) -> None:
    cap = captured(stream)
    assert cap.prompt_token_ids == PROMPTS  # one list per choice: they differ
    assert cap.token_ids == [[20, 30], [21, 31]]
    if stream:
        assert cap.prompt_tokens == 5  # a stream without usage counts both prompts
    row = {"prompt_token_ids": cap.prompt_token_ids, "token_ids": cap.token_ids, "logprobs": cap.logprobs}
    await add_run(engine, "r", completions=[{**row, "endpoint": COMPLETIONS}])
    [run] = await load_runs(engine, ["r"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples, counts = build_samples([run], {"r": 1.0}, tok, 64)
    assert [(s.prompt_ids, s.completion_ids) for s in samples] == [
        ([10, 11], [20, 30]),
        ([12, 13, 14], [21, 31]),
    ]
    assert [s.old_logprobs for s in samples] == [[-0.5, -0.25]] * 2
    assert counts.rebuilt == 0


@pytest.mark.parametrize("stream", [False, True])
def test_one_prompt_stays_one_list(stream: bool) -> None:
    """n > 1 of one prompt (and chat): the stored column keeps its one-list shape."""
    resp, parts = response(), chunks()
    for c in resp["choices"]:
        c["prompt_token_ids"] = PROMPTS[0]
    for p in parts:
        for c in p["choices"]:
            if "prompt_token_ids" in c:
                c["prompt_token_ids"] = PROMPTS[0]
    inj = inject({"prompt": "A B", "n": 2}, COMPLETIONS)
    if stream:
        asm = StreamAssembler(COMPLETIONS, inj)
        for chunk in parts:
            asm.feed(chunk)
        cap = asm.result()
    else:
        cap = from_response(resp, COMPLETIONS, inj)
    assert cap.prompt_token_ids == PROMPTS[0]
