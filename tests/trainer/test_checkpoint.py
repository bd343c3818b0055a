"""Checkpoints: complete or absent, pruned to the newest K, and a resume that continues exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rlproxy.errors import TrainerError
from rlproxy.storage.training import CompletionData, RunData
from rlproxy.trainer import checkpoint as ckpt
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import load_policy
from rlproxy.trainer.step import make_optimizer, train_step


def runs() -> list[RunData]:
    def c(rid: str, toks: list[int]) -> CompletionData:
        return CompletionData(rid, 0, 0, "chat.completions", None, None, [5, 6, 7], [toks], None)

    return [RunData("a", "g", "p", 1.0, [c("a", [8, 9])]), RunData("b", "g", "p", 0.0, [c("b", [10])])]


def lora_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def test_save_resume_continue(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(learning_rate=1e-2, checkpoint_dir=str(tmp_path), seed=0)
    model, tok = load_policy(str(tiny_model_dir), cfg)
    opt = make_optimizer(model, cfg)
    train_step(model, tok, opt, runs(), cfg)
    saved = ckpt.save_checkpoint(tmp_path, "org/policy", 1, model, opt, {"run_ids": ["a", "b"]})
    assert saved.path == tmp_path / "org_policy" / "step-0001"
    assert {p.name for p in saved.path.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
    }
    assert saved.state() == {"run_ids": ["a", "b"], "policy": "org/policy", "step": 1}
    assert ckpt.checkpoint_policies(tmp_path) == ["org/policy"]
    with pytest.raises(TrainerError, match="already exists"):
        ckpt.save_checkpoint(tmp_path, "org/policy", 1, model, opt, {})

    # a second process resumes: same adapter weights, same optimizer moments, same next step
    model2, _ = load_policy(str(tiny_model_dir), cfg, adapter_dir=str(saved.path))
    opt2 = make_optimizer(model2, cfg)
    ckpt.load_optimizer(saved, opt2)
    a, b = lora_state(model), lora_state(model2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    train_step(model, tok, opt, runs(), cfg)
    train_step(model2, tok, opt2, runs(), cfg)
    a, b = lora_state(model), lora_state(model2)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)

    # the folder is a plain peft adapter (what vLLM and the embedded engine load)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    PeftModel.from_pretrained(base, str(saved.path))


def test_atomic_write_and_cleanup(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    cfg = TrainerConfig(checkpoint_dir=str(tmp_path))
    model, _ = load_policy(str(tiny_model_dir), cfg)
    opt = make_optimizer(model, cfg)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, "p", 1, model, opt, {})
    monkeypatch.undo()
    assert ckpt.list_checkpoints(tmp_path, "p") == []
    assert list((tmp_path / "p").iterdir()) == []  # no half folder left behind

    # what a SIGKILL mid-write leaves: a .tmp folder, and a step folder without its state file
    (tmp_path / "p" / ".tmp-step-0002-xyz").mkdir()
    (tmp_path / "p" / "step-0003").mkdir()
    assert ckpt.clean_partial(tmp_path) == 1
    assert ckpt.latest_checkpoint(tmp_path, "p") is None


def test_prune_keeps_newest(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(checkpoint_dir=str(tmp_path))
    model, _ = load_policy(str(tiny_model_dir), cfg)
    opt = make_optimizer(model, cfg)
    for step in range(1, 6):
        ckpt.save_checkpoint(tmp_path, "p", step, model, opt, {"n": step})
    assert ckpt.prune(tmp_path, "p", keep=2) == [1, 2, 3]
    assert [c.step for c in ckpt.list_checkpoints(tmp_path, "p")] == [4, 5]
    last = ckpt.latest_checkpoint(tmp_path, "p")
    assert last is not None and last.step == 5
    assert json.loads((last.path / "trainer_state.json").read_text())["n"] == 5


def test_resume_uses_the_new_optimizer_settings(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 16 bug 4: a restart with another learning rate or weight decay kept the checkpoint's."""
    cfg = TrainerConfig(learning_rate=1e-2, weight_decay=0.0, checkpoint_dir=str(tmp_path), seed=0)
    model, tok = load_policy(str(tiny_model_dir), cfg)
    opt = make_optimizer(model, cfg)
    train_step(model, tok, opt, runs(), cfg)
    saved = ckpt.save_checkpoint(tmp_path, "p", 1, model, opt, {"run_ids": ["a", "b"]})

    new = cfg.model_copy(update={"learning_rate": 3e-4, "weight_decay": 0.05})
    model2, _ = load_policy(str(tiny_model_dir), new, adapter_dir=str(saved.path))
    opt2 = make_optimizer(model2, new)
    ckpt.load_optimizer(saved, opt2)
    assert [(g["lr"], g["weight_decay"]) for g in opt2.param_groups] == [(3e-4, 0.05)]
    # the moments are the checkpoint's
    moments = [s["exp_avg"] for s in opt.state.values()]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, opt2.state.values(), strict=True))
