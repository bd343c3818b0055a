"""train_autocast: the decoder body's matmuls in bf16 on CPU, everything the loss reads in fp32.

Off by default (the suite's trainer is fp32 everywhere); here bf16 is asked for by name, so these
tests run the same on a CPU with native bf16 and one without (slower).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import Capture

from rlproxy.storage.training import CompletionData, RunData
from rlproxy.trainer import model as policy_model
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import body_autocast, load_policy, row_hidden_states, row_logprobs
from rlproxy.trainer.rows import collate_rows
from rlproxy.trainer.segments import assign_weights, build_segments
from rlproxy.trainer.step import train_step


def policy(model_dir: Path, setting: str):
    model, tok = load_policy(str(model_dir), TrainerConfig(seed=0, train_autocast=setting))
    with torch.no_grad():  # the same non-zero adapter in both (B starts at zero)
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model, tok


def group() -> list[RunData]:
    """Three runs of a few chained calls on one task prompt (stored logprobs unknown: ratios from the
    policy itself)."""
    g = torch.Generator().manual_seed(0)
    task = torch.randint(10, 250, (24,), generator=g).tolist()
    runs = []
    for i, (n, reward) in enumerate([(3, 1.0), (2, 0.0), (1, 0.5)]):
        prompt, calls = list(task), []
        for seq in range(n):
            sampled = torch.randint(10, 250, (6,), generator=g).tolist()
            call = CompletionData(f"r{i}", seq, 0, "chat.completions", None, None, prompt, [sampled], None)
            calls.append(call)
            prompt = prompt + sampled + torch.randint(10, 250, (5,), generator=g).tolist()
        runs.append(RunData(f"r{i}", "g", "tiny", reward, calls))
    return runs


def test_the_setting_resolves_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TrainerConfig().train_autocast == "off"  # opt-in: docs/training.md says what it measured
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert body_autocast(cpu, "off") is None
    assert body_autocast(cpu, "bf16") is torch.bfloat16
    assert body_autocast(cuda, "bf16") is None  # CUDA trains bf16 weights: nothing to cast
    monkeypatch.setattr(policy_model, "native_bf16", lambda: True)
    assert body_autocast(cpu, "auto") is torch.bfloat16
    monkeypatch.setattr(policy_model, "native_bf16", lambda: False)
    assert body_autocast(cpu, "auto") is None  # emulated bf16 would be slower than fp32
    with pytest.raises(ValueError):
        TrainerConfig(train_autocast="fp16")


def test_bf16_body_fp32_head_and_a_gradient_close_to_fp32s(tiny_model_dir: Path) -> None:
    runs = group()
    fp32, tok = policy(tiny_model_dir, "off")
    bf16, _ = policy(tiny_model_dir, "bf16")
    assert fp32.rlproxy_autocast is None and bf16.rlproxy_autocast is torch.bfloat16

    # the body's linears run in bf16, its last hidden states (the residual stream) stay fp32
    seen: list[torch.dtype] = []
    layer = bf16.get_base_model().model.layers[0].mlp.down_proj.base_layer
    hook = layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    segments, _ = build_segments(runs, {r.run_id: 1.0 for r in runs}, tok, 4096)
    assign_weights(segments, "grpo", "run", max_seq_len=4096, completion_budget=32)
    rows = collate_rows(segments, tok.pad_token_id)
    with torch.no_grad():
        h = row_hidden_states(bf16, rows)
        logp_bf16 = row_logprobs(bf16, rows)[0]
        logp_fp32 = row_logprobs(fp32, rows)[0]
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert h.dtype == torch.float32 and logp_bf16.dtype == torch.float32
    diff = (logp_bf16 - logp_fp32).abs()
    # rounded, not wrong (the tiny random model: mean 0.017, max 0.058 when this was written)
    assert 0 < float(diff.mean()) < 0.03 and float(diff.max()) < 0.15, diff

    # a whole step: gradients point the same way, their size within a few percent
    grads = {}
    for name, m in (("fp32", fp32), ("bf16", bf16)):
        opt = Capture([p for p in m.parameters() if p.requires_grad])
        cfg = TrainerConfig(loss="grpo", micro_batch_tokens=64, max_grad_norm=1e9)  # 2+ micro-batches
        train_step(m, tok, opt, runs, cfg)
        grads[name] = torch.cat([g.flatten() for g in opt.grads])
    a, b = grads["fp32"], grads["bf16"]
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.99
    assert abs(float(b.norm() / a.norm()) - 1) < 0.05
    assert not torch.equal(a, b)  # bf16 really ran


def test_fused_lora_under_autocast_matches_peft(tiny_model_dir: Path) -> None:
    model, _ = policy(tiny_model_dir, "bf16")
    ids = torch.randint(10, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    fallbacks: list[int] = []
    for m in model.modules():
        if "_unfused_forward" in m.__dict__:
            inner = m._unfused_forward
            m._unfused_forward = lambda *a, _f=inner, **k: (fallbacks.append(1), _f(*a, **k))[1]

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids).logits.float()
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    fused, fused_grads = run()
    assert not fallbacks  # every LoRA layer took the fused path, bf16 inputs or fp32 ones
    for m in model.modules():
        if "_unfused_forward" in m.__dict__:
            m.forward = m._unfused_forward  # peft's own forward
    plain, plain_grads = run()
    rel = float((fused - plain).norm() / plain.norm())
    assert rel < 0.02, rel  # bf16 roundings in another order only
    for f, p in zip(fused_grads, plain_grads, strict=True):
        cos = torch.nn.functional.cosine_similarity(f.flatten(), p.flatten(), dim=0)
        assert float(cos) > 0.99
