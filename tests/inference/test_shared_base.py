"""Issue 21 item 7 (engine side): the trainer can get the base model without a second copy of it."""

from __future__ import annotations

from pathlib import Path

import torch

from rlproxy.inference.engine import Engine


def test_twin_shares_every_weight_and_training_it_leaves_the_engine_alone(
    tiny_model_dir: Path, lora_dirs: dict[str, Path]
) -> None:
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(1)
    engine = Engine(str(tiny_model_dir), threads=1)
    engine.start()
    try:
        engine.load_adapter("a", str(lora_dirs["a"])).result(timeout=60)  # the engine's tree has LoRA
        twin = engine.shared_base().result(timeout=60)
        base = engine.adapters.base
        theirs = {
            n.replace(".base_layer.", "."): p.data_ptr()
            for n, p in base.named_parameters(remove_duplicate=False)
            if ".lora_" not in n
        }
        mine = {n: p.data_ptr() for n, p in twin.named_parameters()}
        assert mine.items() <= theirs.items() and len(mine) > 0  # every weight is the engine's tensor
        ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
        with torch.inference_mode():
            want = engine.call(
                lambda: engine.adapters.model(input_ids=ids, adapter_names=["__base__"])
            ).result()
            assert torch.equal(twin(input_ids=ids).logits, want.logits)
        before = {n: p.detach().clone() for n, p in twin.named_parameters()}

        # the trainer's side: its own LoRA on the twin, one optimizer step
        policy = get_peft_model(
            twin, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
        params = [p for p in policy.parameters() if p.requires_grad]
        assert params and all(".lora_" in n for n, p in policy.named_parameters() if p.requires_grad)
        opt = torch.optim.SGD(params, lr=0.5)
        policy(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        for n, p in base.named_parameters():
            key = n.replace(".base_layer.", ".")
            if key in before:
                assert torch.equal(p, before[key]), n  # the engine's base weights did not move
        with torch.inference_mode():
            again = engine.call(
                lambda: engine.adapters.model(input_ids=ids, adapter_names=["__base__"])
            ).result()
            assert torch.equal(again.logits, want.logits)
            assert not torch.equal(policy(input_ids=ids).logits, want.logits)  # the trainer's LoRA is its own
    finally:
        engine.close()
