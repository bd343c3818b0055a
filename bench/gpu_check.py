"""The trainer's GPU path, run where a GPU is: plain transformers + peft, bf16 weights, fp32 LM head.

    .venv/bin/python bench/gpu_check.py [--model smollm2-135m] [--steps 3]      (make gpu-check)

Without CUDA it says so and exits 0. On CUDA, for gradient checkpointing off and on: load the policy
as the trainer does, check its dtypes (bf16 body, fp32 LM head, dropout off), check that the
shared-prompt path gives the log-probabilities and gradients of running every sample whole, then
time `--steps` GRPO steps (after one warm-up) on 2 groups of 4 samples (64 prompt + 64 completion
tokens, request temperature 0.7, stored logprobs = the model's own raw ones, as the serving engine
would store them) and print tokens/s. Every step must be finite, taken, and its lag-0 samples must
agree with their stored logprobs (`kl/lag0` ~ 0). Exits 1 on any failed check.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

B, PROMPT_LEN, COMPLETION_LEN, GROUP = 8, 64, 64, 4
REWARDS = [1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.0]


def token_data(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two prompts and B completions of random token ids (seed 0)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()  # noqa: E731
    return [rand(PROMPT_LEN) for _ in range(B // GROUP)], [rand(COMPLETION_LEN) for _ in range(B)]


def make_runs(prompts: list[list[int]], comps: list[list[int]], old: list[list[float]] | None) -> list:
    """B rewarded runs in groups of GROUP sharing a prompt, sampled at temperature 0.7."""
    from rlproxy.storage.training import CompletionData, RunData

    out = []
    for i in range(B):
        c = CompletionData(
            f"r{i}", 0, 0, "completions", {"temperature": 0.7}, None,
            prompts[i // GROUP], [comps[i]], [old[i]] if old else None,
        )  # fmt: skip
        out.append(RunData(f"r{i}", f"g{i // GROUP}", "p", REWARDS[i], [c]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model name or folder")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting (after one warm-up)")
    a = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu-check: skipped, no CUDA device (the trainer runs on CPU here)")
        return 0

    from rlproxy.inference.models import resolve_model
    from rlproxy.trainer.batches import build_samples, collate
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy, token_logprobs
    from rlproxy.trainer.step import make_optimizer, train_step

    model_dir = resolve_model(a.model)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)

    for checkpointing in (False, True):
        cfg = TrainerConfig(learning_rate=1e-5, micro_batch_size=B, gradient_checkpointing=checkpointing)
        print(f"{a.model} on {torch.cuda.get_device_name()}, gradient checkpointing {checkpointing}")
        model, tok = load_policy(model_dir, cfg)
        head = model.get_output_embeddings()
        check(next(model.parameters()).dtype == torch.bfloat16, "body in bf16")
        check(head.weight.dtype == torch.float32, "LM head in fp32")
        check(all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout)), "dropout off")

        prompts, comps = token_data(len(tok))
        runs = partial(make_runs, prompts, comps)

        samples, _ = build_samples(runs(None), {f"r{i}": 0.0 for i in range(B)}, tok, 4096)
        batch = collate(samples, tok.pad_token_id)
        batch.temperature = None  # the raw distribution: what the server stores by default
        with torch.no_grad():
            old = token_logprobs(model, batch).tolist()

        # the shared-prompt path (off under checkpointing) against every sample whole
        results = []
        for shared in (True, False):
            b = collate(samples, tok.pad_token_id)
            if not shared:
                b.prompt_ids = None
            model.zero_grad()
            logp = token_logprobs(model, b)
            (logp * b.mask).sum().backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
            results.append((logp.detach(), grads))
        (lp1, g1), (lp2, g2) = results
        check(torch.allclose(lp1, lp2, atol=5e-2), f"shared prompts: |dlogp| {(lp1 - lp2).abs().max():.2e}")
        rel = ((g1 - g2).norm() / g2.norm().clamp(min=1e-12)).item()
        check(rel < 5e-2, f"shared prompts: relative gradient difference {rel:.2e}")
        model.zero_grad(set_to_none=True)

        opt = make_optimizer(model, cfg)
        data, times = runs(old), []
        for i in range(a.steps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = train_step(model, tok, opt, data, cfg)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            m = r.metrics
            check(not r.skipped and m["loss/grad_norm"] == m["loss/grad_norm"], f"step {i}: taken, finite")
            if i == 0:
                check(m["kl/lag0"] < 0.02, f"step 0: lag-0 approx KL {m['kl/lag0']:.2e} (logprobs agree)")
        tokens = B * (PROMPT_LEN + COMPLETION_LEN)
        best, med = min(times), sorted(times)[len(times) // 2]
        print(f"  {tokens / med:.0f} tokens/s median, {tokens / best:.0f} best over {len(times)} steps")
        print(f"  peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        del model, opt
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    print("gpu-check: " + ("all checks passed" if not failures else f"{len(failures)} FAILED: {failures}"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
