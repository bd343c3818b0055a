"""Merged segments on the tiny model: the same gradients as one sample per call, memory by token budget.

The oracle is the per-call path (tests/oracle.py), run in `old_gradients` below as train_step ran it
before segments (build_samples -> micro_batches -> completion_logits -> policy_loss x batch_weight).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from oracle import (
    batch_weight,
    build_samples,
    collate,
    completion_logits,
    micro_batches,
    policy_loss,
    token_logprobs,
)
from support import Capture

from rlproxy.storage.training import CompletionData, RunData
from rlproxy.trainer import losses
from rlproxy.trainer.batches import baseline_index
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import load_policy, row_logprobs
from rlproxy.trainer.rows import collate_rows
from rlproxy.trainer.segments import assign_weights, build_segments
from rlproxy.trainer.step import train_step


def lora(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path):
    model, tok = load_policy(str(tiny_model_dir), TrainerConfig(seed=0))
    with torch.no_grad():  # a non-zero adapter, so the LoRA path of context tokens matters
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model, tok


def chain_calls(run_id: str, first: list[int], n: int, g: torch.Generator, *, temps=None, steps=None):
    """n calls, each prompt = previous prompt + sampled ids + a new turn (random ids, random lengths)."""
    calls, prompt = [], list(first)
    for i in range(n):
        sampled = torch.randint(10, 250, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        req = {"temperature": temps[i]} if temps else None
        step = steps[i] if steps else 0
        calls.append(
            CompletionData(run_id, i, step, "chat.completions", req, None, list(prompt), [sampled], None)
        )
        prompt = prompt + sampled + torch.randint(10, 250, (4,), generator=g).tolist()
    return calls


def with_stored_logprobs(model, tok, runs: list[RunData], g: torch.Generator) -> list[RunData]:
    """Store what the server would have: the model's own raw logprobs, off by some noise (ratios != 1)."""
    for run in runs:
        for c in run.completions:
            probe = RunData(
                "x",
                "g",
                "tiny",
                0.0,
                [CompletionData("x", 0, 0, None, None, None, c.prompt_token_ids, c.token_ids, None)],
            )
            samples, _ = build_samples([probe], {"x": 0.0}, tok, 4096)
            with torch.no_grad():
                lp = token_logprobs(model, collate(samples, tok.pad_token_id))[0]
            c.logprobs = [(lp + 0.15 * torch.randn(lp.shape, generator=g)).tolist()]
    return runs


def episodes(model, tok) -> list[RunData]:
    g = torch.Generator().manual_seed(0)
    task = torch.randint(10, 250, (20,), generator=g).tolist()  # the group's shared first prompt
    a = chain_calls("a", task, 5, g, temps=[0.7, 1.0, 0.7, 1.0, 0.5], steps=[0, 0, 1, 1, 1])
    b = chain_calls("b", task, 3, g, steps=[1, 1, 1])
    at = len(b[1].prompt_token_ids)  # a break: call 1's reply re-rendered differently in call 2's prompt
    b[2].prompt_token_ids = b[2].prompt_token_ids[:at] + [7] + b[2].prompt_token_ids[at:]
    c = chain_calls("c", task, 1, g, steps=[1])
    runs = [
        RunData("a", "g", "tiny", 1.0, a),
        RunData("b", "g", "tiny", 0.0, b),
        RunData("c", "g", "tiny", 0.25, c),
    ]
    return with_stored_logprobs(model, tok, runs, g)


def old_gradients(
    model, tok, runs: list[RunData], cfg: TrainerConfig, current_step: int
) -> list[torch.Tensor]:
    """The gradient of train_step before segments: one sample per call, micro-batch means weighted."""
    eps_low, eps_high = losses.clip_range(cfg.loss, cfg.epsilon, cfg.epsilon_high)
    _, index = baseline_index(runs)
    adv, _ = losses.advantages(
        torch.tensor([r.reward for r in runs], dtype=torch.float64), index, cfg.scale_rewards
    )
    adv_of = {r.run_id: float(x) for r, x in zip(runs, adv.tolist(), strict=True)}
    samples, _ = build_samples(
        runs, adv_of, tok, cfg.max_seq_len, current_step=current_step, max_policy_lag=cfg.max_policy_lag
    )
    total = sum(len(s.completion_ids) for s in samples)
    for p in lora(model):
        p.grad = None
    for batch in micro_batches(samples, cfg.micro_batch_size, tok.pad_token_id):
        logits = completion_logits(model, batch)
        logp = losses.sampled_logprobs(logits, batch.completion_ids, batch.temperature)
        raw = (
            logp
            if batch.temperature is None
            else losses.sampled_logprobs(logits.detach(), batch.completion_ids)
        )
        old = losses.behavior_logprobs(logp, raw, batch.old_logp, cfg.sampling_logprobs)
        loss = policy_loss(
            logp, old, None, batch.advantages, batch.mask, kind=cfg.loss, epsilon=eps_low,
            epsilon_high=eps_high, max_len=cfg.max_seq_len, ratio_cap=cfg.ratio_cap,
        )  # fmt: skip
        (loss * batch_weight(cfg.loss, batch.mask, len(samples), total)).backward()
    out = [p.grad.detach().clone() for p in lora(model)]
    for p in lora(model):
        p.grad = None
    return out


def new_gradients(model, tok, runs, cfg: TrainerConfig, current_step: int):
    opt = Capture(lora(model))
    result = train_step(model, tok, opt, runs, cfg, current_step=current_step)
    return opt.grads, result


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_merged_equals_per_call_gradients(policy, loss: str) -> None:
    """Under loss_weighting=per_call, merged segments give today's gradient to <= 1e-6 (a break, a
    stale call, per-call temperatures and policy steps included)."""
    model, tok = policy
    runs = episodes(model, tok)
    base = TrainerConfig(
        loss=loss, loss_weighting="per_call", max_grad_norm=1e9, max_policy_lag=0, micro_batch_size=4
    )
    oracle = old_gradients(model, tok, runs, base, current_step=1)
    merged, result = new_gradients(model, tok, runs, base, current_step=1)
    unmerged, result_unmerged = new_gradients(
        model, tok, runs, base.model_copy(update={"merge_calls": False}), 1
    )
    m = result.metrics
    assert m["batch/stale"] == 2.0  # run a's first two calls: drawn by step 0, trained at step 1
    assert m["merge/breaks"] == 1.0 and m["merge/segments"] == 4.0  # a, b (2: the break), c
    assert (
        m["merge/positions_merged"]
        < m["merge/positions_unmerged"]
        == result_unmerged.metrics["merge/positions_merged"]
    )
    scale = max(float(g.abs().max()) for g in oracle)
    assert scale > 1e-4  # a gradient worth comparing
    for got in (merged, unmerged):
        assert max(float((a - b).abs().max()) for a, b in zip(got, oracle, strict=True)) <= 1e-6
    assert result.loss == pytest.approx(result_unmerged.loss, abs=1e-6)


def test_run_weighting_differs_from_per_call(policy) -> None:
    model, tok = policy
    runs = episodes(model, tok)
    cfg = TrainerConfig(max_grad_norm=1e9, max_policy_lag=None)
    run_w, _ = new_gradients(model, tok, runs, cfg, 1)
    call_w, _ = new_gradients(model, tok, runs, cfg.model_copy(update={"loss_weighting": "per_call"}), 1)
    assert max(float((a - b).abs().max()) for a, b in zip(run_w, call_w, strict=True)) > 1e-5


def test_shared_prefix_runs_once_same_values_and_gradients(policy) -> None:
    model, tok = policy
    runs = episodes(model, tok)
    segs, _ = build_segments(runs, {"a": 1.0, "b": -1.0, "c": 0.5}, tok, 4096)
    assign_weights(segs, "grpo", "run", max_seq_len=4096)
    results = []
    for shared in (True, False):
        rows = collate_rows(segs, tok.pad_token_id)
        assert rows.shared == 20  # the group's task prompt
        if not shared:
            rows.shared = 0
        logp, raw, ent, _ = row_logprobs(model, rows)
        (logp * rows.advantages).sum().backward()
        results.append((logp.detach(), ent, [p.grad.clone() for p in lora(model)]))
        for p in lora(model):
            p.grad = None
    (l1, e1, g1), (l2, e2, g2) = results
    assert torch.allclose(l1, l2, atol=1e-5) and torch.allclose(e1, e2, atol=1e-5)
    scale = max(float(a.abs().max()) for a in g1)  # ~7: fp32 sums in another order differ ~1e-6 of it
    assert max(float((a - b).abs().max()) for a, b in zip(g1, g2, strict=True)) <= 1e-5 * scale


def test_head_probabilities_kept_within_their_budget_same_gradients(policy, monkeypatch) -> None:
    """Chunks past HEAD_KEEP_BYTES recompute their logits in backward: same values and gradients."""
    from rlproxy.trainer import model as model_module

    model, tok = policy
    runs = episodes(model, tok)
    segs, _ = build_segments(runs, {"a": 1.0, "b": -1.0, "c": 0.5}, tok, 4096)
    assign_weights(segs, "grpo", "run", max_seq_len=4096)
    rows = collate_rows(segs, tok.pad_token_id)
    head = model.get_base_model().get_output_embeddings()
    chunk, vocab = 4, head.weight.shape[0]
    assert rows.num_tokens > 3 * chunk
    calls = []
    hook = head.register_forward_hook(lambda *_: calls.append(1))
    results = []
    for kept_chunks in (10**6, 2, 0):  # all kept, the first two, none
        monkeypatch.setattr(model_module, "HEAD_KEEP_BYTES", kept_chunks * 4 * chunk * vocab)
        calls.clear()
        logp, _, ent, _ = row_logprobs(model, rows, chunk=chunk)
        (logp * rows.advantages).sum().backward()
        n_chunks = -(-rows.num_tokens // chunk)
        assert len(calls) == n_chunks + max(n_chunks - kept_chunks, 0)  # a recomputed chunk runs twice
        results.append((logp.detach(), ent, [p.grad.clone() for p in lora(model)]))
        for p in lora(model):
            p.grad = None
    hook.remove()
    (l1, e1, g1) = results[0]
    for l2, e2, g2 in results[1:]:
        assert torch.equal(l1, l2) and torch.equal(e1, e2)
        assert max(float((a - b).abs().max()) for a, b in zip(g1, g2, strict=True)) <= 1e-6


class SavedBytes:
    """Bytes of the tensors autograd keeps for backward, live at once (parameters excluded): the
    activation memory of a step, which is what grows with the tokens of a micro-batch. Transient
    buffers (one LM-head chunk) are not saved, so not counted."""

    def __init__(self, model) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, saved tensors still alive]
        self.now = self.peak = 0

    def _drop(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params or ptr == 0:
            return t
        entry = self.live.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._drop, ptr)
        return t

    def __enter__(self) -> SavedBytes:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


def long_episodes(n_runs: int, n_calls: int) -> list[RunData]:
    g = torch.Generator().manual_seed(3)
    task = torch.randint(10, 250, (40,), generator=g).tolist()
    runs = []
    for i in range(n_runs):
        calls = chain_calls(f"r{i}", task, n_calls, g)
        for c in calls:
            c.logprobs = [[-3.0] * len(c.token_ids[0])]
        runs.append(RunData(f"r{i}", "g", "tiny", float(i % 2), calls))
    return runs


def peak_saved(policy, runs, **cfg) -> tuple[int, dict[str, float]]:
    model, tok = policy
    config = TrainerConfig(max_grad_norm=1e9, **cfg)
    with SavedBytes(model) as saved:
        result = train_step(model, tok, Capture(lora(model)), runs, config)
    return saved.peak, result.metrics


def test_peak_memory_follows_micro_batch_tokens(policy) -> None:
    """A long episode (16 calls) per run: the per-call path keeps every call's whole prompt (and its
    (B, C, V) logits) for backward; merged rows in a token budget keep budget x (bytes per position)."""
    runs = long_episodes(8, 16)
    segs, _ = build_segments(runs, {r.run_id: 0.0 for r in runs}, None, 4096)
    row = max(len(s) for s in segs)  # ~ 40 + 16 x ~7.5 positions
    one, m1 = peak_saved(policy, runs, micro_batch_tokens=row)  # one row per micro-batch
    four, m4 = peak_saved(policy, runs, micro_batch_tokens=4 * row)
    assert m1["perf/micro_batches"] == 8.0 and m4["perf/micro_batches"] == 2.0
    per_position = one / row
    assert four <= 1.1 * 4 * row * per_position  # bounded by the budget
    # twice the runs, same budget: the same peak (memory follows the budget, not the step's size)
    more, _ = peak_saved(policy, long_episodes(16, 16), micro_batch_tokens=4 * row)
    assert more <= 1.1 * four
    # the old path: one sample per call, 8 per micro-batch, prompts repeated
    model, tok = policy
    with SavedBytes(model) as saved:
        old_gradients(model, tok, runs, TrainerConfig(loss_weighting="per_call", micro_batch_size=8), 0)
    unmerged, _ = peak_saved(
        policy, runs, merge_calls=False, loss_weighting="per_call", micro_batch_tokens=None
    )
    # measured: 24.5 MB (per call, the old path), 10.1 MB merged in 4 rows, and one row per call on the
    # prefix tree 5.7 MB (each call's prompt is the previous call's row: the tree runs it once)
    assert saved.peak > 2 * four and unmerged < saved.peak / 3


async def test_sql_says_why_a_run_split(policy, engine, add_run) -> None:
    """Per step: positions merged vs unmerged and breaks as columns; per run: segments and why."""
    from sqlalchemy import text

    from rlproxy.storage.training import commit_step, load_runs, step_columns

    model, tok = policy
    first = [5, 17, 42, 99, 7]
    calls = [
        {"prompt_token_ids": first, "token_ids": [[11, 12]], "logprobs": [[-1.0, -1.0]]},
        {"prompt_token_ids": first + [11, 12, 30], "token_ids": [[13]], "logprobs": [[-1.0]]},
        {"prompt_token_ids": first + [11, 99, 30, 13, 31], "token_ids": [[14]], "logprobs": [[-1.0]]},
    ]
    await add_run(engine, "split", reward=1.0, completions=calls)
    await add_run(engine, "whole", reward=0.0, completions=calls[:2])
    runs = await load_runs(engine, ["split", "whole"])
    result = train_step(model, tok, Capture(lora(model)), runs, TrainerConfig())
    await commit_step(
        engine, policy="tiny", step=1, run_ids=["split", "whole"], adapter_path=None,
        metrics=result.metrics, columns=step_columns(result.metrics), run_segments=result.run_segments,
    )  # fmt: skip
    async with engine.connect() as conn:
        step = (
            await conn.execute(
                text("SELECT positions_merged, positions_unmerged, segment_breaks FROM training_steps")
            )
        ).one()
        split = (
            await conn.execute(text("SELECT id, segments, segment_breaks FROM runs WHERE segments > 1"))
        ).all()
    # split: [5 + 2 + 1 + 1] = 9 and a new row of 10 + 1; whole: 9. Unmerged: (7 + 9 + 11) + (7 + 9)
    assert tuple(step) == (9 + 11 + 9, 43, 1)
    assert [(r.id, r.segments, json.loads(r.segment_breaks)) for r in split] == [
        ("split", 2, [{"seq": 2, "reason": "prefix_mismatch", "at": 6, "of": 9}])
    ]


def test_a_prefix_its_micro_batches_share_runs_once_per_step(policy, monkeypatch) -> None:
    """One row per micro-batch: the group's task prompt runs once for all of them (StepPrefix), and
    the gradient is still the per-call oracle's to <= 1e-6."""
    model, tok = policy
    runs = episodes(model, tok)
    base = TrainerConfig(
        loss="grpo", loss_weighting="per_call", max_grad_norm=1e9, max_policy_lag=0, micro_batch_size=1
    )
    oracle = old_gradients(model, tok, runs, base, current_step=1)
    made = count_prefixes(monkeypatch)
    got, result = new_gradients(model, tok, runs, base, 1)
    assert result.metrics["perf/micro_batches"] == 4.0
    assert made == [(20, False)]  # the task prompt of runs a, b, c: once, not once per micro-batch
    assert result.metrics["perf/positions_run"] < result.metrics["perf/input_tokens"] - 2 * 20
    assert max(float((a - b).abs().max()) for a, b in zip(got, oracle, strict=True)) <= 1e-6


def count_prefixes(monkeypatch) -> list[tuple[int, bool]]:
    """(tokens run, on a parent) of every StepPrefix the step builds."""
    from rlproxy.trainer import model as model_module

    made: list[tuple[int, bool]] = []
    real = model_module.StepPrefix

    def counted(m, ids, parent=None):
        made.append((len(ids), parent is not None))
        return real(m, ids, parent)

    monkeypatch.setattr(model_module, "StepPrefix", counted)
    return made


def test_a_tree_of_prefixes_runs_each_once_with_the_per_call_gradient(policy, monkeypatch) -> None:
    """Runs a and b share a long history (b picks up where a's third call began: a fork), c only the
    task prompt, and b breaks: one row per micro-batch, the prefixes form a tree of two levels, each
    node runs once (the deeper one on its parent's cache), and the gradient is the per-call oracle's
    to <= 1e-6."""
    model, tok = policy
    g = torch.Generator().manual_seed(5)
    task = torch.randint(10, 250, (20,), generator=g).tolist()
    a = chain_calls("a", task, 4, g)
    history = a[3].prompt_token_ids  # 20 + 3 x (2..5 sampled + 4) positions
    b = chain_calls("b", history, 3, g)
    at = len(b[1].prompt_token_ids)  # a break at b's third call, as in `episodes`
    b[2].prompt_token_ids = b[2].prompt_token_ids[:at] + [7] + b[2].prompt_token_ids[at:]
    c = chain_calls("c", task, 2, g)
    runs = [
        RunData("a", "g", "tiny", 1.0, a),
        RunData("b", "g", "tiny", 0.0, b),
        RunData("c", "g", "tiny", 0.5, c),
    ]
    runs = with_stored_logprobs(model, tok, runs, g)
    base = TrainerConfig(loss="grpo", loss_weighting="per_call", max_grad_norm=1e9, micro_batch_size=1)
    oracle = old_gradients(model, tok, runs, base, current_step=0)
    made = count_prefixes(monkeypatch)
    got, result = new_gradients(model, tok, runs, base, 0)
    assert result.metrics["merge/breaks"] == 1.0
    # the task prompt, then a's history past it for a, b and b's second segment, on the first
    assert made == [(20, False), (len(history) - 20, True)]
    # 4 rows: the task prompt once, not 4 times; the history past it once, not 3 times
    merged = result.metrics["merge/positions_merged"]
    assert result.metrics["perf/positions_run"] == merged - 3 * 20 - 2 * (len(history) - 20)
    assert max(float((x - y).abs().max()) for x, y in zip(got, oracle, strict=True)) <= 1e-6
