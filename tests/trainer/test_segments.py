"""Merging a run's calls into segments (rules, counts) and the per-token weights, with exact numbers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlproxy.storage.training import CompletionData, RunData
from rlproxy.trainer.losses import advantages
from rlproxy.trainer.rows import micro_batches_by_tokens
from rlproxy.trainer.segments import assign_weights, build_segments, default_budget

P = [5, 17, 42, 99, 7]


def call(seq: int, prompt: list[int], tokens: list[int], *, step: int = 0, **kw) -> CompletionData:
    lps = kw.pop("logprobs", [-0.5] * len(tokens))
    return CompletionData(
        "r", seq, step, "chat.completions", kw.pop("request", None), None, prompt, [tokens], [lps]
    )


def episode(run_id: str, reward: float, calls: list[CompletionData]) -> RunData:
    for c in calls:
        c.run_id = run_id
    return RunData(run_id, "g", "tiny", reward, calls)


def chain(n: int, first: list[int] = P, tokens: int = 2, turn: int = 3, **kw) -> list[CompletionData]:
    """n calls, each prompt = the previous prompt + its sampled ids + a new turn of `turn` tokens."""
    out, prompt = [], list(first)
    for i in range(n):
        sampled = [100 + 10 * i + k for k in range(tokens)]
        out.append(call(i, list(prompt), sampled, **kw))
        prompt = prompt + sampled + [200 + 10 * i + k for k in range(turn)]
    return out


def build(runs, **kw):
    return build_segments(runs, {r.run_id: 1.0 for r in runs}, None, 512, **kw)


def test_extending_calls_become_one_segment() -> None:
    calls = chain(3)
    segs, counts = build([episode("a", 1.0, calls)])
    assert len(segs) == 1 and counts.breaks == 0
    last = calls[-1]
    assert segs[0].ids == last.prompt_token_ids + last.token_ids[0]  # the last call's whole sample
    trained = [t for t, on in zip(segs[0].ids, segs[0].trained, strict=True) if on]
    assert trained == [100, 101, 110, 111, 120, 121]  # the sampled ids only, each once
    assert counts.positions_merged == 5 + 2 + 3 + 2 + 3 + 2  # 17
    assert counts.positions_unmerged == (5 + 2) + (10 + 2) + (15 + 2)  # 36, what per-call runs
    assert counts.metrics()["merge/saved_frac"] == pytest.approx(1 - 17 / 36)
    # one sample per call without merging: the per-call path's rows exactly
    segs, counts = build([episode("a", 1.0, chain(3))], merge=False)
    assert [len(s) for s in segs] == [
        7,
        12,
        17,
    ] and counts.positions_merged == counts.positions_unmerged == 36


def test_a_break_is_counted_and_restarts_from_the_stored_prompt() -> None:
    calls = chain(3)
    calls[2].prompt_token_ids = list(calls[2].prompt_token_ids)
    calls[2].prompt_token_ids[6] = 999  # a template that re-rendered call 0's reply differently
    segs, counts = build([episode("a", 1.0, calls)])
    assert counts.breaks == 1 and len(segs) == 2
    assert segs[1].ids == calls[2].prompt_token_ids + calls[2].token_ids[0]  # from the stored prompt
    assert not any(segs[1].trained[: len(calls[2].prompt_token_ids)])  # the history is context only
    rows = counts.run_breaks()
    n, why = rows["a"]
    assert n == 2 and json.loads(why) == [{"seq": 2, "reason": "prefix_mismatch", "at": 6, "of": 12}]
    assert counts.metrics()["merge/breaks"] == 1.0


def test_a_retry_is_not_trained_twice() -> None:
    """An SDK retry re-sends the same prompt: the first answer is abandoned, the retry's continues."""
    c0 = call(0, P, [100, 101])
    c1 = call(1, P, [110, 111, 112])  # the retry
    c2 = call(2, P + [110, 111, 112, 7, 8], [120])  # the agent went on from the retry's answer
    segs, counts = build([episode("a", 1.0, [c0, c1, c2])])
    assert len(segs) == 1 and counts.breaks == 0 and counts.retries == 1 and counts.abandoned_tokens == 2
    assert segs[0].ids == P + [110, 111, 112, 7, 8, 120]
    assert [t for t, on in zip(segs[0].ids, segs[0].trained, strict=True) if on] == [110, 111, 112, 120]
    assert counts.sampled_tokens == 4
    # without the retry rule (one sample per call) P would run 3 times and [100, 101] would train
    _, per_call = build(
        [episode("a", 1.0, [call(0, P, [100, 101]), call(1, P, [110, 111, 112])])], merge=False
    )
    assert per_call.sampled_tokens == 5


def test_choices_branch_without_training_history_twice() -> None:
    c0 = call(0, P, [100, 101])
    c1 = CompletionData(
        "a", 1, 0, "chat.completions", None, None, P + [100, 101, 9], [[1, 2], [3]], [[-1.0, -1.0], [-1.0]]
    )
    segs, counts = build([episode("a", 1.0, [c0, c1])])
    assert counts.branches == 1 and counts.breaks == 0 and len(segs) == 2
    trained = sorted(t for s in segs for t, on in zip(s.ids, s.trained, strict=True) if on)
    assert trained == [1, 2, 3, 100, 101]  # history once, each choice once


def test_stale_call_is_masked_not_dropped() -> None:
    calls = chain(3, step=0)
    for c in calls[1:]:
        c.policy_step = 9
    segs, counts = build([episode("a", 1.0, calls)], current_step=10, max_policy_lag=2)
    assert counts.stale == 1 and len(segs) == 1
    assert segs[0].ids == calls[2].prompt_token_ids + calls[2].token_ids[0]  # still the context
    assert segs[0].ids[5:7] == [100, 101] and segs[0].trained[5:7] == [False, False]
    assert counts.sampled_tokens == 4 and counts.policy_steps == [9, 9]
    # a run whose every call is stale has nothing to train
    segs, counts = build([episode("b", 1.0, chain(2))], current_step=10, max_policy_lag=2)
    assert segs == [] and counts.stale == 2


def test_run_weights_exact_numbers() -> None:
    """A 5-call run and a 1-call run in one group: per run each weighs 1/2, however many calls."""
    req = {"max_tokens": 4}
    runs = [
        episode("five", 1.0, chain(5, request=req)),
        episode("one", 0.0, [call(0, P, [7, 8, 9], request=req)]),
    ]
    segs, _ = build(runs)
    by = {s.run_id: s for s in segs}

    def weights(kind: str, weighting: str, **kw) -> dict[str, list[float]]:
        assign_weights(segs, kind, weighting, max_seq_len=512, **kw)
        return {rid: [w for w, on in zip(s.weight, s.trained, strict=True) if on] for rid, s in by.items()}

    w = weights("grpo", "run")
    assert w["five"] == [1 / 20] * 10 and w["one"] == [1 / 6] * 3  # 1 / (N_runs |run's tokens|)
    assert sum(w["five"]) == pytest.approx(0.5) and sum(w["one"]) == pytest.approx(0.5)
    w = weights("grpo", "per_call")  # today's: each call a sequence, the 5-call run weighs 5/6
    assert w["five"] == [1 / 12] * 10 and w["one"] == [1 / 18] * 3
    assert sum(w["five"]) == pytest.approx(5 / 6)
    w = weights("dapo", "run")
    assert w["five"] == [1 / 13] * 10 and w["one"] == [1 / 13] * 3
    budget = default_budget(runs)
    assert budget == 20  # the 5-call run may sample 5 x 4 tokens
    w = weights("dr_grpo", "run", completion_budget=budget)
    assert w["five"] == [1 / 40] * 10 and w["one"] == [1 / 40] * 3
    w = weights("dr_grpo", "per_call")
    assert w["five"] == [1 / (6 * 512)] * 10
    w = weights("gspo", "run")  # one segment per run: the run's ratio, weight 1/2 per run
    assert w["five"] == [1 / 20] * 10 and w["one"] == [1 / 6] * 3
    rows = micro_batches_by_tokens(segs, 0, max_rows=8, max_tokens=None)
    assert rows[0].ratio_group.unique().numel() == 2
    rows = micro_batches_by_tokens(segs, 0, max_rows=8, max_tokens=None, ratio_by="call")
    assert rows[0].ratio_group.unique().numel() == 6


def test_micro_batches_follow_the_token_budget() -> None:
    runs = [episode(f"r{i}", float(i), chain(4)) for i in range(6)]  # 6 segments of 22 positions
    segs, _ = build(runs)
    assert {len(s) for s in segs} == {22}
    for budget, rows in ((22, 1), (44, 2), (100, 4), (None, 6)):
        parts = micro_batches_by_tokens(segs, 0, max_rows=8, max_tokens=budget)
        assert [p.input_ids.shape[0] for p in parts][0] == rows
        assert sum(p.num_tokens for p in parts) == sum(s.num_trained for s in segs)
        assert all(p.positions <= max(budget or 10**9, 22) for p in parts)
    parts = micro_batches_by_tokens(segs, 0, max_rows=8, max_tokens=None)
    assert parts[0].shared == 21  # identical rows: all but the last position run once
    one = [episode(f"r{i}", 1.0, chain(2, first=[i] + P)) for i in range(2)]
    assert (
        micro_batches_by_tokens(build(one)[0], 0, max_rows=8, max_tokens=None)[0].shared == 0
    )  # differ at 0


@pytest.mark.parametrize("scale", ["group", "none"])
def test_advantages_finite_for_any_finite_rewards(scale: str) -> None:
    """Rewards near float64's limit used to overflow the group's sum: NaN advantages, a wrecked step."""
    rewards = torch.tensor([1e308, -1e308, 1e300, 0.0], dtype=torch.float64)
    index = torch.tensor([0, 0, 1, 1])
    adv, m = advantages(rewards, index, scale)
    assert torch.isfinite(adv).all() and all(math.isfinite(v) for v in m.values())
    if scale == "group":
        h = 1 / math.sqrt(2)
        assert adv.tolist() == pytest.approx([h, -h, h, -h], rel=1e-6)
    else:  # centered: [1e308, -1e308, 5e299, -5e299], all scaled down together to a largest of 1e6
        assert adv.tolist() == pytest.approx([1e6, -1e6, 5e-3, -5e-3], rel=1e-6)
    # ordinary rewards: exactly as before
    adv, _ = advantages(
        torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64), torch.tensor([0, 0, 1, 1]), scale
    )
    g0, g1 = 0.5 / (math.sqrt(0.5) + 1e-4), 0.125 / (math.sqrt(2 * 0.125**2) + 1e-4)  # c / (std + eps)
    expected = [0.5, -0.5, 0.125, -0.125] if scale == "none" else [g0, -g0, g1, -g1]
    assert adv.tolist() == pytest.approx(expected, rel=1e-4)


def test_trainer_modules_import_one_way() -> None:
    """Issue 23 item 4: config <-> reporting <-> step <-> distributed <-> model imported each other
    (lazily or for types); now the arrows form no cycle, type-only and function-level imports included."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "rlproxy" / "trainer"
    mods = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    edges: dict[str, set[str]] = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((folder / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlproxy.trainer"):
                names = (
                    [node.module.rsplit(".", 1)[-1]]
                    if node.module != "rlproxy.trainer"
                    else [n.name for n in node.names]
                )
                deps |= {n for n in names if n in mods and n != m}
        edges[m] = deps

    def reaches(a: str, b: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(d == b or (d not in seen and reaches(d, b, seen | {d})) for d in edges[a])

    core = ["config", "reporting", "step", "distributed", "model", "batches", "segments", "rows", "losses"]
    assert [m for m in core if reaches(m, m)] == []


def test_groups_are_packed_apart_so_each_shares_its_prompt() -> None:
    """Two groups of 4 with their own 20-token task prompts: packed together the rows share nothing;
    packed by prefix each micro-batch runs its group's prompt once (as the per-call path did)."""
    runs = [episode(f"g{g}r{i}", 1.0, chain(1, first=[g + 1] * 20)) for g in range(2) for i in range(4)]
    parts = micro_batches_by_tokens(build(runs)[0], 0, max_rows=8, max_tokens=None)
    assert [p.input_ids.shape[0] for p in parts] == [4, 4]
    assert [p.shared for p in parts] == [21, 21]


def test_micro_batches_are_planned_on_the_tree_of_shared_prefixes() -> None:
    """A and B share an 80-token history, C only its first 40 (the task prompt), D nothing: two nodes,
    the deeper on the first, each micro-batch under its deepest; A and B, 50 positions apart in
    length, are not padded together (PAD_LIMIT), so the history runs once as a node of its own."""
    from rlproxy.trainer.rows import PAD_LIMIT
    from rlproxy.trainer.segments import Segment

    def seg(name: str, ids: list[int]) -> Segment:
        n = len(ids)
        return Segment(
            name, 1.0, ids, [False] * (n - 1) + [True], [math.nan] * n, [1.0] * n, [0] * n,
            [-1] * (n - 1) + [0], [0.0] * (n - 1) + [1.0],
        )  # fmt: skip

    task = list(range(1, 41))
    history = task + list(range(100, 140))
    segs = [
        seg("A", history + [1] * 60),
        seg("B", history + [2] * 10),
        seg("C", task + [3] * 50),
        seg("D", [9] * 30),
    ]
    assert 140 - 90 > PAD_LIMIT
    parts = micro_batches_by_tokens(segs, 0, max_rows=8, max_tokens=None)
    got = [([s.run_id for s in p.segments], [length for _, length in p.prefix]) for p in parts]
    assert got == [(["D"], []), (["C"], [40]), (["A"], [40, 80]), (["B"], [40, 80])]
    assert len({p.prefix[0][0] for p in parts if p.prefix}) == 1  # one node of 40 for C, A and B
    run = sum(p.positions_run(prefixed=True) for p in parts)
    assert run + 40 + (80 - 40) == 30 + 50 + 60 + 10 + 80  # every position once: the tree's size
    # rows of about one length still share a micro-batch, and then its `shared` prefix, not a node
    close = [seg("A", history + [1] * 20), seg("B", history + [2] * 10)]
    (one,) = micro_batches_by_tokens(close, 0, max_rows=8, max_tokens=None)
    assert one.prefix == () and one.shared == 80
