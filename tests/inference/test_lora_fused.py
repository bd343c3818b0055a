"""The fused LoRA forward (inference/lora_fused.py) against peft's own, on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlproxy.inference.lora_fused import fuse_lora


def lora_model(model_dir: Path, dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]
    )
    model = get_peft_model(base, config)
    with torch.no_grad():  # B starts at zero: make the adapter matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def unfuse(model) -> None:
    for m in model.modules():
        if "_unfused_forward" in m.__dict__:
            del m.forward, m._unfused_forward  # the class's (peft's) forward again


def run(model, ids):
    for p in model.parameters():
        p.grad = None
    logits = model(input_ids=ids).logits
    (logits.square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(10, 250, (2, 9), generator=torch.Generator().manual_seed(1))


def counting(model) -> list[int]:
    """Count the calls that fall back to peft's forward."""
    calls: list[int] = []
    for m in model.modules():
        if "_unfused_forward" in m.__dict__:
            inner = m._unfused_forward
            m._unfused_forward = lambda *a, _f=inner, **k: (calls.append(1), _f(*a, **k))[1]
    return calls


def test_same_values_and_gradients_as_peft(tiny_model_dir: Path, ids: torch.Tensor) -> None:
    model = lora_model(tiny_model_dir)
    model.train()
    n = fuse_lora(model)
    assert n == 4 * model.config.num_hidden_layers
    assert fuse_lora(model) == 0  # idempotent
    calls = counting(model)
    fused_logits, fused_grads = run(model, ids)
    assert calls == []  # every layer took the fused path
    unfuse(model)
    logits, grads = run(model, ids)
    assert torch.allclose(fused_logits, logits, atol=1e-6, rtol=1e-5)
    assert grads.keys() == fused_grads.keys() and len(grads) == 2 * n
    for k in grads:
        assert torch.allclose(fused_grads[k], grads[k], atol=1e-7, rtol=1e-4), k


def test_disabled_adapter_and_dropout_run_peft_forward(tiny_model_dir: Path, ids: torch.Tensor) -> None:
    model = lora_model(tiny_model_dir, dropout=0.5)
    model.eval()  # dropout off in eval: fused
    fuse_lora(model)
    calls = counting(model)
    with torch.no_grad():
        model(input_ids=ids)
        assert calls == []
        with model.disable_adapter():  # the reference model of the KL term: the base alone
            off = model(input_ids=ids).logits
        assert len(calls) == 4 * model.config.num_hidden_layers
        base = model.get_base_model()
        unfuse(model)
        with model.disable_adapter():
            assert torch.equal(off, base(input_ids=ids).logits)
    fuse_lora(model)
    calls = counting(model)
    model.train()  # dropout 0.5 in training: peft's own forward, its random masks
    model(input_ids=ids)
    assert len(calls) == 4 * model.config.num_hidden_layers


def test_mixed_adapter_batch_runs_peft_forward(tiny_model_dir: Path, ids: torch.Tensor, tmp_path: Path):
    """The engine's mixed batch (`adapter_names`, one adapter per row) is peft's; one adapter is fused."""
    model = lora_model(tiny_model_dir)
    model.save_pretrained(str(tmp_path / "a"))
    model.load_adapter(str(tmp_path / "a"), adapter_name="b")
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, adapter_names=["default", "__base__"]).logits
        fuse_lora(model)
        calls = counting(model)
        got = model(input_ids=ids, adapter_names=["default", "__base__"]).logits
        assert len(calls) == 4 * model.config.num_hidden_layers and torch.equal(got, want)
        calls.clear()
        model.set_adapter("b")
        one = model(input_ids=ids).logits
        assert calls == [] and torch.allclose(one[0], want[0], atol=1e-5)  # b has default's weights
