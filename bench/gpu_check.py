"""`make gpu-check`: rlproxy's CUDA paths on a GPU box, with nothing fetched from outside, in minutes.

    .venv/bin/python bench/gpu_check.py [--model tiny] [--steps 3] [--nproc 1] [--cpu]

Needs PyTorch, transformers, peft (the install), no vLLM and no network: the model is `tiny`, made
locally (`rlproxy models make-tiny`), unless `--model` names another. Three parts, each printed:

1. trainer: for gradient checkpointing off and on, load the policy as the trainer does (CUDA: bf16
   body, fp32 LM head, dropout off), check that the shared-prompt path gives the log-probabilities
   and gradients of running every sample whole, then time `--steps` GRPO steps (after one warm-up)
   on 2 groups of 4 samples (64 prompt + 64 completion tokens, request temperature 0.7, stored
   logprobs = the model's own raw ones). Every step must be finite and taken, and its lag-0 samples
   must agree with their stored logprobs (`kl/lag0` ~ 0). Prints tokens/s and peak memory.
2. embedded engine: start it on the model, answer a chat completion, load the adapter the trainer
   just saved (`/v1/load_lora_adapter`) and answer from it. (It runs on CPU by design; on GPUs
   vLLM serves.)
3. distributed launcher: `rlproxy train --nproc N` (torch.distributed.run; NCCL on CUDA) on a fresh
   SQLite store holding 2 rewarded groups of 4 runs, publishing to that engine, until its step is
   committed; prints the backend, the ranks and the step time.

Without CUDA, part 1 is skipped with a message (`--cpu` runs it on CPU, fp32, for the test that keeps
this script from rotting) and parts 2 and 3 run on CPU (gloo). Exits 1 on any failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

B, PROMPT_LEN, COMPLETION_LEN, GROUP = 8, 64, 64, 4
REWARDS = [1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.0]
POLICY = "gpu-check"


class Checks:
    """Prints each check as it runs; remembers the failures."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failures.append(what)


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
        out.append(RunData(f"r{i}", f"g{i // GROUP}", POLICY, REWARDS[i], [c]))
    return out


def trainer_part(model_dir: str, steps: int, out: Path, check: Checks) -> Path:
    """Part 1 on the device load_policy picks; returns the folder of the adapter it saved."""
    import torch

    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy, row_logprobs
    from rlproxy.trainer.rows import collate_rows
    from rlproxy.trainer.segments import build_segments
    from rlproxy.trainer.step import make_optimizer, train_step

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    where = torch.cuda.get_device_name() if cuda else "CPU"
    saved = out / "adapter"
    for checkpointing in (False, True):
        cfg = TrainerConfig(learning_rate=1e-5, micro_batch_size=B, gradient_checkpointing=checkpointing)
        print(
            f"trainer: {Path(model_dir).name} on {where}, gradient checkpointing {checkpointing}", flush=True
        )
        model, tok = load_policy(model_dir, cfg)
        body = torch.bfloat16 if cuda else torch.float32
        check(next(model.parameters()).dtype == body, f"body in {str(body).removeprefix('torch.')}")
        check(model.get_output_embeddings().weight.dtype == torch.float32, "LM head in fp32")
        check(all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout)), "dropout off")

        prompts, comps = token_data(len(tok))
        runs = partial(make_runs, prompts, comps)
        segs, _ = build_segments(runs(None), {f"r{i}": 0.0 for i in range(B)}, tok, 4096, merge=False)
        with torch.no_grad():  # the raw distribution (T = 1): what the server stores by default
            raw = row_logprobs(model, collate_rows(segs, tok.pad_token_id))[1]
        old = [x.tolist() for x in raw.split([s.num_trained for s in segs])]

        # one group's rows on their shared prompt (off under checkpointing) against every row whole
        results = []
        for shared in (True, False):
            rows = collate_rows(segs[:GROUP], tok.pad_token_id)  # a group's rows share its prompt
            if not shared:
                rows.shared = 0  # every row whole
            model.zero_grad()
            logp = row_logprobs(model, rows)[0]
            logp.sum().backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
            results.append((logp.detach(), grads))
        (lp1, g1), (lp2, g2) = results
        check(torch.allclose(lp1, lp2, atol=5e-2), f"shared prompts: |dlogp| {(lp1 - lp2).abs().max():.2e}")
        rel = ((g1 - g2).norm() / g2.norm().clamp(min=1e-12)).item()
        check(rel < 5e-2, f"shared prompts: relative gradient difference {rel:.2e}")
        model.zero_grad(set_to_none=True)

        opt = make_optimizer(model, cfg)
        data, times = runs(old), []
        for i in range(steps + 1):
            sync()
            t0 = time.perf_counter()
            r = train_step(model, tok, opt, data, cfg)
            sync()
            if i:
                times.append(time.perf_counter() - t0)
            m = r.metrics
            check(not r.skipped and m["loss/grad_norm"] == m["loss/grad_norm"], f"step {i}: taken, finite")
            if i == 0:
                check(m["kl/lag0"] < 0.02, f"step 0: lag-0 approx KL {m['kl/lag0']:.2e} (logprobs agree)")
        tokens = B * (PROMPT_LEN + COMPLETION_LEN)
        best, med = min(times), sorted(times)[len(times) // 2]
        line = f"step {med * 1000:.0f} ms median ({tokens / med:.0f} tokens/s)"
        print(f"  {line}, {tokens / best:.0f} tokens/s best over {len(times)} steps", flush=True)
        if cuda:
            print(f"  peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
            torch.cuda.reset_peak_memory_stats()
        if not saved.exists():
            model.save_pretrained(str(saved))
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
    return saved


def random_adapter(model_dir: str, out: Path) -> Path:
    """A fresh LoRA as the trainer makes it (for part 2 when part 1 was skipped)."""
    from rlproxy.trainer.config import TrainerConfig
    from rlproxy.trainer.model import load_policy

    model, _ = load_policy(model_dir, TrainerConfig())
    model.save_pretrained(str(out / "adapter"))
    return out / "adapter"


async def engine_part(model_dir: str, adapter: Path, check: Checks) -> Any:
    """Part 2; returns the started engine (part 3 publishes to it)."""
    import httpx

    from rlproxy.inference.embedded import EmbeddedBackend

    print("embedded engine (CPU by design: on GPUs vLLM serves)", flush=True)
    backend = EmbeddedBackend(model_dir, threads=1)
    t0 = time.perf_counter()
    await backend.start()
    print(f"  started in {time.perf_counter() - t0:.1f} s at {backend.base_url}", flush=True)
    body = {"messages": [{"role": "user", "content": "Say a word."}], "max_tokens": 8, "logprobs": True}
    async with httpx.AsyncClient(base_url=backend.base_url, timeout=120) as client:
        for model in (backend.served_model, "engine-check@1"):
            if model != backend.served_model:
                t0 = time.perf_counter()
                await backend.load_adapter(model, str(adapter))
                print(f"  loaded adapter {model} in {(time.perf_counter() - t0) * 1000:.0f} ms", flush=True)
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json={**body, "model": model})
            ms = (time.perf_counter() - t0) * 1000
            ok = r.status_code == 200 and bool(r.json()["choices"][0]["logprobs"])
            check(ok, f"chat completion from {model}: {r.status_code} in {ms:.0f} ms, with logprobs")
    return backend


async def launcher_part(model_dir: str, upstream: str, nproc: int, out: Path, check: Checks) -> None:
    """Part 3: `rlproxy train --nproc N` commits one step from a fresh store."""
    import torch
    from sqlalchemy import insert, text

    from rlproxy.storage.db import create_engine, upgrade_async
    from rlproxy.storage.models import Completion, Run

    backend = "NCCL" if torch.cuda.is_available() else "gloo"
    print(f"distributed launcher: rlproxy train --nproc {nproc} ({backend})", flush=True)
    url = f"sqlite+aiosqlite:///{out / 'rlproxy.db'}"
    await upgrade_async(url)
    engine = create_engine(url)
    from transformers import AutoTokenizer

    prompts, comps = token_data(len(AutoTokenizer.from_pretrained(model_dir)))
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        for i in range(B):
            await conn.execute(
                insert(Run).values(id=f"r{i}", group_id=f"g{i // GROUP}", policy=POLICY, status="completed",
                                   reward=REWARDS[i], created_at=now, completed_at=now)
            )  # fmt: skip
            await conn.execute(
                insert(Completion).values(run_id=f"r{i}", seq=0, policy=POLICY, policy_step=0, status="ok",
                                          prompt_token_ids=prompts[i // GROUP], token_ids=[comps[i]],
                                          created_at=now)  # before the reward: a run trains only those
            )  # fmt: skip
    env = {
        **os.environ,
        "RLPROXY_CHECKPOINT_DIR": str(out / "checkpoints"),
        "RLPROXY_LEARNING_RATE": "1e-5",
        "RLPROXY_POLL_INTERVAL": "0.2",
        "OMP_NUM_THREADS": "1",
    }
    cli = Path(sys.executable).with_name("rlproxy")
    cmd = [str(cli), "train", "--nproc", str(nproc), "--db", url, "--upstream", upstream, "--model",
           model_dir, "--group-size", str(GROUP), "--groups-per-step", str(B // GROUP)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    row = None
    try:
        while row is None and proc.poll() is None and time.perf_counter() - t0 < 300:
            await asyncio.sleep(0.5)
            async with engine.connect() as conn:
                row = (await conn.execute(text("SELECT step, num_runs, metrics FROM training_steps"))).first()
        ready = time.perf_counter() - t0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
        await engine.dispose()
    check(
        row is not None and row[0] == 1 and row[1] == B,
        f"step 1 committed, {B} runs, {ready:.0f} s after start",
    )
    check(proc.returncode == 0, f"stopped by SIGTERM, exit {proc.returncode}")
    check(f"({backend.lower()})" in log, f"ranks joined on {backend}")
    if row is not None:
        m = json.loads(row[2]) if isinstance(row[2], str) else row[2]
        print(f"  step {m['perf/step_seconds']:.2f} s on {m['perf/ranks']:.0f} rank(s) (train "
              f"{m['perf/seconds']:.2f} s), {m['perf/tokens_per_s']:.0f} tokens/s", flush=True)  # fmt: skip
    if check.failures:
        print(log[-4000:], flush=True)


async def run(a: argparse.Namespace) -> int:
    import torch

    from rlproxy.inference.models import resolve_model

    check = Checks()
    model_dir = resolve_model(a.model)
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)  # CPU mode is a smoke test on a shared box, not a measurement
    device = f"CUDA {torch.cuda.get_device_name()}" if cuda else "no CUDA"
    print(f"gpu-check: torch {torch.__version__}, {device}, model {a.model} ({model_dir})", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlproxy-gpu-check-") as tmp:
        out = Path(tmp)
        if cuda or a.cpu:
            adapter = await asyncio.to_thread(trainer_part, model_dir, a.steps, out, check)
        else:
            print("trainer: skipped, no CUDA device (--cpu runs it on CPU)", flush=True)
            adapter = await asyncio.to_thread(random_adapter, model_dir, out)
        engine = await engine_part(model_dir, adapter, check)
        try:
            await launcher_part(model_dir, engine.base_url, a.nproc, out, check)
        finally:
            await engine.stop()
    done = "all checks passed" if not check.failures else f"{len(check.failures)} FAILED: {check.failures}"
    print(f"gpu-check: {done}" + ("" if cuda else " (no CUDA: the CUDA parts did not run)"), flush=True)
    return 1 if check.failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="model name or folder (tiny: made here, nothing fetched)")
    ap.add_argument(
        "--steps", type=int, default=3, help="timed trainer steps per setting (after one warm-up)"
    )
    ap.add_argument("--nproc", type=int, default=1, help="ranks of the launcher part (one GPU each)")
    ap.add_argument("--cpu", action="store_true", help="without CUDA, run the trainer part on CPU anyway")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
