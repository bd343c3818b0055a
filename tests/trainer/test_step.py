"""One GRPO step on the tiny model with real peft: the sign of the advantage moves log-probabilities."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from oracle import build_samples, collate, token_logprobs

from rlproxy.storage.training import CompletionData, RunData
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import (
    fp32_lm_head,
    gradient_checkpointing,
    load_policy,
    reference_row_logprobs,
    row_logprobs,
)
from rlproxy.trainer.rows import collate_rows
from rlproxy.trainer.segments import build_segments
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
    # a fresh LoRA adapter starts as the identity: policy == reference (the step's KL term)
    rows = collate_rows(build_segments([short, long], {"s": 0.0, "l": 0.0}, tok, 512)[0], tok.pad_token_id)
    with torch.no_grad():
        assert torch.allclose(reference_row_logprobs(model, rows), row_logprobs(model, rows)[0], atol=1e-6)


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


def lora_weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def randomize_lora(model) -> None:
    with torch.no_grad():  # a non-zero adapter, so the prompt's LoRA path matters
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)


def test_gradient_checkpointing_same_gradients(tiny_model_dir: Path, config: TrainerConfig) -> None:
    """Issue 16 bug 2: under gradient checkpointing the shared-prompt path raised (no KV cache with grads).

    With it on, every row runs whole: same log-probabilities and gradients as without.
    """
    long = PROMPT * 4  # a prompt long enough to be run once (rows.MIN_SHARED)
    runs = [run(r, 0.0, t, prompt=long) for r, t in (("a", GOOD), ("b", BAD), ("c", [30, 31]))]
    results = []
    for on in (False, True):
        model, tok = load_policy(
            str(tiny_model_dir), config.model_copy(update={"gradient_checkpointing": on})
        )
        assert gradient_checkpointing(model) == on
        randomize_lora(model)
        segs, _ = build_segments(runs, {"a": 1.0, "b": -2.0, "c": 0.5}, tok, 512)
        rows = collate_rows(segs, tok.pad_token_id)
        assert rows.shared == len(long)  # the prompt the rows share runs once (without checkpointing)
        logp = row_logprobs(model, rows)[0]
        (logp * rows.advantages).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
        # and a whole step runs
        assert not train_step(model, tok, make_optimizer(model, config), runs, config).skipped
    (lp1, g1), (lp2, g2) = results
    assert torch.allclose(lp1, lp2, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(g1, g2, strict=True))


def test_non_finite_gradient_skips_the_step(tiny_model_dir: Path, config: TrainerConfig, caplog) -> None:
    """Issue 16 bug 3: a step whose gradient norm is not finite was applied (and published) anyway."""
    model, tok = load_policy(str(tiny_model_dir), config)
    opt = make_optimizer(model, config)
    runs = [run("a", 1.0, GOOD), run("b", 0.0, BAD)]
    before = lora_weights(model)
    param = next(p for p in model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: g * float("nan"))
    result = train_step(model, tok, opt, runs, config)
    assert result.skipped and result.metrics["step/skipped_nonfinite"] == 1.0
    assert "step skipped" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, lora_weights(model), strict=True))
    assert not opt.state  # AdamW never stepped: its moments are untouched too
    hook.remove()
    result = train_step(model, tok, opt, runs, config)  # still trainable
    assert not result.skipped and result.metrics["step/skipped_nonfinite"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, lora_weights(model), strict=True))


def test_stand_in_logprob_does_not_wreck_the_adapter(tiny_model_dir: Path, config: TrainerConfig) -> None:
    """Issue 16 bug 3: a stored -9999 gave an infinite ratio; the step was applied, the weights NaN."""
    model, tok = load_policy(str(tiny_model_dir), config)
    opt = make_optimizer(model, config)
    runs = [run("a", 1.0, GOOD, [-1.0, -9999.0, -1.0, -1.0]), run("b", 0.0, BAD, [-1.0, -1.0, -1.0])]
    result = train_step(model, tok, opt, runs, config)
    assert result.metrics["batch/invalid_logprobs"] == 1.0 and result.num_tokens == 3
    assert not result.skipped and math.isfinite(result.loss)
    assert all(torch.isfinite(w).all() for w in lora_weights(model))


def test_temperature_semantics_and_logprob_mode_mismatch(
    tiny_model_dir: Path, config: TrainerConfig, caplog
) -> None:
    """Issue 16 risk 5: at lag 0 the stored logprobs must match; a wrong logprob mode is flagged, not silent.

    The server sampled at T = 0.25 and stored raw logprobs (vLLM's default, the embedded engine's).
    sampling_logprobs=raw: ratio exactly 1, no warning. processed: the tempered policy against raw
    logprobs: far from 1, `kl/logprob_mismatch` and a warning.
    """
    model, tok = load_policy(str(tiny_model_dir), config)
    randomize_lora(model)
    toks = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
    samples, _ = build_samples([run("a", 0, toks[0]), run("b", 0, toks[1])], {"a": 0, "b": 0}, tok, 512)
    with torch.no_grad():
        raw = token_logprobs(
            model, collate(samples, tok.pad_token_id)
        )  # no temperature: the raw distribution

    def runs() -> list[RunData]:
        out = [
            run(rid, r, t, raw[i].tolist())
            for i, (rid, r, t) in enumerate([("a", 1.0, toks[0]), ("b", 0.0, toks[1])])
        ]
        for r in out:
            r.completions[0].request = {"temperature": 0.25}
        return out

    no_step = config.model_copy(update={"learning_rate": 1e-12})
    m = train_step(model, tok, make_optimizer(model, no_step), runs(), no_step).metrics
    assert m["clip/ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["kl/lag0"] == pytest.approx(
        0.0, abs=1e-6
    )
    assert m["kl/lag0_tokens"] == 20.0 and m["kl/logprob_mismatch"] == 0.0
    assert "disagree with their stored logprobs" not in caplog.text

    wrong = no_step.model_copy(update={"sampling_logprobs": "processed"})
    m = train_step(model, tok, make_optimizer(model, wrong), runs(), wrong).metrics
    assert m["kl/lag0"] > 0.02 and m["kl/logprob_mismatch"] == 1.0
    assert "disagree with their stored logprobs" in caplog.text
    # a sample of an older adapter is not lag 0: it cannot be judged
    m = train_step(model, tok, make_optimizer(model, wrong), runs(), wrong, current_step=1).metrics
    assert m["kl/lag0_tokens"] == 0.0 and m["kl/logprob_mismatch"] == 0.0


def test_dropout_is_off_while_training(tiny_model_dir: Path, tmp_path: Path, config: TrainerConfig) -> None:
    """Issue 16 risk 7: dropout in the training forward made every ratio noisy (serving has none)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.5}))
    model, tok = load_policy(str(folder), config)
    assert model.training
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    samples, _ = build_samples([run("a", 0.0, GOOD)], {"a": 0.0}, tok, 512)
    batch = collate(samples, tok.pad_token_id)
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, batch), token_logprobs(model, batch))


def test_fp32_lm_head(tiny_model_dir: Path) -> None:
    """Issue 16 risk 7: on GPU (bf16 weights) the logits come from an fp32 copy of the LM head."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    fp32_lm_head(model)
    assert model.get_output_embeddings().weight.dtype == torch.float32
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out, expected = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert out.dtype == torch.float32
    assert torch.allclose(out, expected, atol=0.1)  # bf16 body, fp32 head
