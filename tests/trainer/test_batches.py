"""Calls as training reads them (segments.build_segments, one per call): exact ids, aligned old logprobs,
counted fallbacks; seen through the oracle's samples (tests/oracle.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from oracle import build_samples
from transformers import AutoTokenizer

from rlproxy.storage.training import CompletionData, RunData


def comp(
    prompt: list[int] | None, tokens: list[list[int]] | None, logprobs: list | None = None, **kw
) -> CompletionData:
    return CompletionData(
        run_id=kw.pop("run_id", "r"),
        seq=0,
        policy_step=kw.pop("policy_step", 0),
        endpoint="chat.completions",
        request=kw.pop("request", None),
        response=kw.pop("response", None),
        prompt_token_ids=prompt,
        token_ids=tokens,
        logprobs=logprobs,
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_samples_from_token_ids(tokenizer) -> None:
    runs = [
        RunData("a", "g", "tiny", 1.0, [comp([1, 2, 3], [[4, 5]], [[-0.5, -0.25]], policy_step=3)]),
        # two turns, the second with two choices (n=2): three samples for run b
        RunData(
            "b",
            "g",
            "tiny",
            0.0,
            [
                comp([1, 2], [[6]], [[-1.0]]),
                comp([1, 2, 6, 7], [[8, 9, 10], [11]], [[-0.1, None, -0.3], [-0.4]]),
            ],
        ),
    ]
    samples, counts = build_samples(runs, {"a": 1.0, "b": -1.0}, tokenizer, max_seq_len=64)
    # a null logprob (orjson's -inf) for a sampled token: that record is broken, the sample is left out
    assert [(s.run_id, s.advantage) for s in samples] == [("a", 1.0), ("b", -1.0), ("b", -1.0)]
    assert samples[0].policy_step == 3
    assert samples[2].completion_ids == [11]
    assert (counts.samples, counts.rebuilt, counts.truncated, counts.sampled_tokens) == (3, 0, 0, 4)
    assert counts.invalid_logprobs == 1


@pytest.mark.parametrize("bad", [-9999.0, float("-inf"), float("nan"), -1e4, None])
def test_stand_in_logprobs_leave_the_sample_out(tokenizer, bad) -> None:
    """Issue 16 bug 3: -9999 (a server's -inf) passed the finiteness check and gave an infinite loss."""
    runs = [
        RunData("a", "g", "tiny", 1.0, [comp([1, 2], [[4, 5]], [[-0.5, bad]])]),
        RunData("b", "g", "tiny", 0.0, [comp([1, 2], [[6]], [[-30.0]])]),  # very unlikely is still data
    ]
    samples, counts = build_samples(runs, {"a": 1.0, "b": -1.0}, tokenizer, max_seq_len=64)
    assert [s.run_id for s in samples] == ["b"] and samples[0].old_logprobs == [-30.0]
    assert counts.metrics()["batch/invalid_logprobs"] == 1.0


def test_batched_completions_each_choice_its_own_prompt(tokenizer) -> None:
    """Issue 16 bug 1: a batched /v1/completions trained every choice on the first choice's prompt."""
    c = comp([[10, 11], [12, 13, 14]], [[20], [21, 22]], [[-0.1], [-0.2, -0.3]])
    samples, _ = build_samples([RunData("a", "g", "tiny", 1.0, [c])], {"a": 1.0}, tokenizer, 64)
    assert [(s.prompt_ids, s.completion_ids) for s in samples] == [([10, 11], [20]), ([12, 13, 14], [21, 22])]
    # rebuilt from text (no token ids stored): the choice's own prompt too, n choices per prompt
    req = {"prompt": ["hello", "good night"], "n": 2}
    resp = {"choices": [{"text": t} for t in ("a", "b", "c", "d")]}
    c = comp(None, None, None, request=req, response=resp)
    samples, _ = build_samples([RunData("a", "g", "tiny", 1.0, [c])], {"a": 1.0}, tokenizer, 64)
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert [s.prompt_ids for s in samples] == [enc("hello")] * 2 + [enc("good night")] * 2


def test_stale_overlong_and_temperature(tokenizer) -> None:
    """Issue 16 risks 5-7: a sample keeps its request's temperature; stale and cut samples are left out."""
    cut = {"choices": [{"text": "x", "finish_reason": "length"}]}
    runs = [
        RunData("old", "g", "tiny", 1.0, [comp([1], [[4]], [[-0.5]], policy_step=1)]),
        RunData(
            "hot", "g", "tiny", 1.0, [comp([1], [[5]], [[-0.5]], policy_step=2, request={"temperature": 0.7})]
        ),
        RunData(
            "greedy",
            "g",
            "tiny",
            1.0,
            [comp([1], [[6]], [[-0.5]], policy_step=3, request={"temperature": 0})],
        ),
        RunData("cut", "g", "tiny", 1.0, [comp([1], [[7]], [[-0.5]], policy_step=3, response=cut)]),
    ]
    adv = {r.run_id: 0.0 for r in runs}
    kw = {"current_step": 4, "max_policy_lag": 2, "default_temperature": 0.5}
    samples, counts = build_samples(runs, adv, tokenizer, 64, overlong_filter=True, **kw)
    assert [(s.run_id, s.temperature) for s in samples] == [("hot", 0.7), ("greedy", 1.0)]
    assert (counts.stale, counts.overlong) == (1, 1)
    samples, _ = build_samples(runs, adv, tokenizer, 64, **kw)
    assert [(s.run_id, s.temperature) for s in samples][-1] == ("cut", 0.5)  # no temperature: the server's


def test_truncation_and_drop_are_counted(tokenizer) -> None:
    runs = [
        RunData("long", "g", "tiny", 1.0, [comp(list(range(1, 11)), [list(range(20, 30))], [[-1.0] * 10])]),
        RunData("huge", "g", "tiny", 0.0, [comp(list(range(1, 17)), [[5]], [[-1.0]])]),
    ]
    samples, counts = build_samples(runs, {"long": 1.0, "huge": -1.0}, tokenizer, max_seq_len=16)
    [s] = samples
    assert len(s.prompt_ids) + len(s.completion_ids) == 16
    assert s.completion_ids == list(range(20, 26)) and len(s.old_logprobs) == 6
    assert (counts.truncated, counts.dropped) == (1, 1)
    assert counts.metrics()["batch/truncated"] == 1.0


def test_fallback_rebuilds_with_chat_template(tokenizer) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    reply = {"role": "assistant", "content": "hi friend"}
    c = comp(None, None, None, request={"messages": messages}, response={"choices": [{"message": reply}]})
    samples, counts = build_samples([RunData("a", "g", "tiny", 1.0, [c])], {"a": 1.0}, tokenizer, 256)
    [s] = samples
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert s.prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(s.completion_ids) == "hi friend<|im_end|>"
    assert all(math.isnan(x) for x in s.old_logprobs)
    assert (counts.rebuilt, counts.missing_logprobs) == (1, 1)
    # mismatched logprobs count as missing too
    c2 = comp([1], [[2, 3]], [[-1.0]])
    _, counts = build_samples([RunData("b", "g", "tiny", 1.0, [c2])], {"b": 1.0}, tokenizer, 256)
    assert (counts.rebuilt, counts.missing_logprobs) == (0, 1)
