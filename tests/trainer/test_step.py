"""One GRPO step on the tiny model with real peft: the sign of the advantage moves log-probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlproxy.storage.training import CompletionData, RunData
from rlproxy.trainer.batches import build_samples, collate
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import load_policy, reference_logprobs, token_logprobs
from rlproxy.trainer.step import make_optimizer, train_step

PROMPT = [5, 17, 42, 99, 7]
GOOD = [11, 12, 13, 14]
BAD = [21, 22, 23]


def run(
    run_id: str, reward: float, tokens: list[int], logprobs: list[float] | None = None, prompt=PROMPT
) -> RunData:
    c = CompletionData(
        run_id, 0, 0, "chat.completions", None, None, prompt, [tokens], [logprobs] if logprobs else None
    )
    return RunData(run_id, "g", "tiny", reward, [c])


def seq_logp(model, tokenizer, prompt: list[int], tokens: list[int]) -> float:
    samples, _ = build_samples([run("x", 0.0, tokens, prompt=prompt)], {"x": 0.0}, tokenizer, 512)
    with torch.no_grad():
        return token_logprobs(model, collate(samples, tokenizer.pad_token_id)).sum().item()


@pytest.fixture
def config(tmp_path: Path) -> TrainerConfig:
    return TrainerConfig(learning_rate=5e-3, micro_batch_size=1, checkpoint_dir=str(tmp_path / "ck"), seed=0)


def test_padding_does_not_change_logprobs(tiny_model_dir: Path, config: TrainerConfig) -> None:
    model, tok = load_policy(str(tiny_model_dir), config)
    short = run("s", 0.0, [8, 9])
    long = run("l", 0.0, GOOD + BAD, prompt=PROMPT + [3, 4, 6, 1, 2])
    samples, _ = build_samples([short, long], {"s": 0.0, "l": 0.0}, tok, 512)
    with torch.no_grad():
        both = token_logprobs(model, collate(samples, tok.pad_token_id))
        alone = token_logprobs(model, collate(samples[:1], tok.pad_token_id))
    assert torch.isfinite(both).all()
    assert torch.allclose(both[0, :2], alone[0], atol=1e-5)  # left padding + position ids = no padding at all
    # a fresh LoRA adapter starts as the identity: policy == reference
    ref = reference_logprobs(model, collate(samples, tok.pad_token_id))
    assert torch.allclose(ref, both, atol=1e-6)


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_advantage_sign_moves_logprobs(tiny_model_dir: Path, config: TrainerConfig, loss: str) -> None:
    config = config.model_copy(update={"loss": loss, "beta": 0.04 if loss == "grpo" else 0.0})
    model, tok = load_policy(str(tiny_model_dir), config)
    opt = make_optimizer(model, config)
    before_good, before_bad = seq_logp(model, tok, PROMPT, GOOD), seq_logp(model, tok, PROMPT, BAD)
    # stored sampling logprobs = the model's own (on-policy), as the serving engine would have stored them
    samples, _ = build_samples([run("a", 0, GOOD), run("b", 0, BAD)], {"a": 0, "b": 0}, tok, 512)
    with torch.no_grad():
        old = token_logprobs(model, collate(samples, tok.pad_token_id))
    runs = [run("a", 1.0, GOOD, old[0, :4].tolist()), run("b", 0.0, BAD, old[1, :3].tolist())]

    result = train_step(model, tok, opt, runs, config, current_step=2)

    assert seq_logp(model, tok, PROMPT, GOOD) > before_good + 1e-3  # positive advantage: more likely
    assert seq_logp(model, tok, PROMPT, BAD) < before_bad - 1e-3  # negative advantage: less likely
    m = result.metrics
    assert (result.num_runs, result.num_groups, result.num_tokens) == (2, 1, 7)
    assert result.mean_reward == 0.5
    assert m["clip/ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy: stored == current
    assert m["perf/policy_lag_mean"] == 2.0  # sampled by step 0, trained at step 2
    assert m["perf/micro_batches"] == 2.0
    assert ("kl/ref" in m) == (loss == "grpo")
    for k in ("loss/total", "loss/grad_norm", "reward/mean", "batch/samples", "perf/tokens_per_s"):
        assert k in m


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_micro_batches_accumulate_to_the_full_batch(
    tiny_model_dir: Path, config: TrainerConfig, loss: str
) -> None:
    seen = []
    for mbs in (1, 8):
        cfg = config.model_copy(update={"micro_batch_size": mbs, "loss": loss})
        model, tok = load_policy(str(tiny_model_dir), cfg)
        opt = make_optimizer(model, cfg)
        runs = [run("a", 1.0, GOOD), run("b", 0.0, BAD), run("c", 0.5, [30, 31])]
        m = train_step(model, tok, opt, runs, cfg).metrics
        seen.append((m["loss/total"], m["loss/grad_norm"], m["perf/micro_batches"]))
    (loss1, norm1, n1), (loss8, norm8, n8) = seen
    assert (n1, n8) == (3.0, 1.0)
    # the gradient norm is read before clipping: the same accumulated gradient either way
    assert loss1 == pytest.approx(loss8, abs=1e-6)
    assert norm1 == pytest.approx(norm8, rel=1e-4)


def test_shared_prompts_same_logprobs_and_gradients(tiny_model_dir: Path, config: TrainerConfig) -> None:
    model, tok = load_policy(str(tiny_model_dir), config)
    with torch.no_grad():  # a non-zero adapter, so the prompt's LoRA path matters
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    runs = [
        run("a", 1.0, GOOD),
        run("b", 0.0, BAD),
        run("c", 0.5, [30]),
        run("d", 0.2, [8, 9], prompt=[4, 6]),
    ]
    samples, _ = build_samples(runs, {r.run_id: r.reward for r in runs}, tok, 512)
    batch = collate(samples, tok.pad_token_id)
    assert batch.shared_prompts and batch.prompt_ids.shape[0] == 2
    results = []
    for shared in (True, False):
        b = batch if shared else collate(samples, tok.pad_token_id)
        if not shared:
            b.prompt_ids = None  # force the one-row-per-sample path
        model.zero_grad()
        logp = token_logprobs(model, b)
        (logp * b.mask * torch.tensor([[1.0], [-2.0], [0.5], [3.0]])).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((logp.detach() * b.mask, grads))
    (lp1, g1), (lp2, g2) = results
    assert torch.allclose(lp1, lp2, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(g1, g2, strict=True))
