"""Training as a torch.distributed job: `rlproxy train --nproc N` runs N ranks of one GRPO step.

    rank 0 (the TrainerService)                        ranks 1..N-1 (followers)
    select groups ──> Leader.train_step ──cmd──────────>  follow(): wait for a command
                      broadcast LoRA weights ─────────>   copy them in
                      train_step on its share            train_step on its share
                      all-reduce LoRA grads (SUM) <─────> all-reduce LoRA grads (SUM)
                      clip, AdamW step                    (nothing: others only compute)
    checkpoint ──> publish ──> commit (rank 0 only)

Every rank builds the same samples from the same runs (deterministic), takes its share (whole groups,
balanced by tokens: `share`), and weights its micro-batches by the *step's* sample and token counts,
so the summed gradient is the single-process step's gradient (up to fp32 summation order, ~1e-7
relative). Rank 0 alone selects, checkpoints, commits and publishes: exactly-once and crash recovery
are the single-process trainer's, since nothing else touches the store or the checkpoint folder.

Plain all-reduce, not DDP's bucketed hooks or FSDP/ZeRO: only the LoRA weights train (~1 MB per
million parameters), so their gradient is one small flat tensor per step, and every rank holds the
frozen base model whole. Sharding pays only when the *base* model does not fit one GPU; then FSDP2
(`fully_shard` on the decoder layers, base weights sharded, LoRA weights replicated) is the tool.

Failure is fail-stop: a rank that dies mid-step leaves the others blocked in a collective; torchrun's
agent sees the death and tears the job down; the next start resumes from the newest checkpoint (a
step saved but not committed is committed once, an unsaved one is trained again). Commands travel
on their own gloo group with a long timeout, because followers may wait hours between steps.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import signal
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlproxy.errors import TrainerError
from rlproxy.storage.training import RunData
from rlproxy.trainer import checkpoint as ckpt
from rlproxy.trainer.batches import baseline_group
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import load_policy, trainable_parameters
from rlproxy.trainer.segments import Segment
from rlproxy.trainer.step import make_optimizer, train_step

log = logging.getLogger(__name__)

COMMAND_TIMEOUT = timedelta(days=365)  # followers wait on rank 0 for as long as no group is ready
_PR_SET_PDEATHSIG = 1


class Ranks:
    """This process's place in the job and the two groups it talks on."""

    def __init__(self, rank: int, world: int, device: torch.device, commands: Any) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.commands = commands  # gloo group: pickled commands and metrics (CPU, long timeout)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, samples: list[Segment], runs: list[RunData]) -> list[Segment]:
        """This rank's samples of the step (see `share`)."""
        return share(samples, runs, self.rank, self.world)

    def reduce(
        self, model: Any, loss: float, sums: dict[str, float], lag0: tuple[float, float], micro: int
    ) -> tuple[float, dict[str, float], tuple[float, float], int]:
        """Sum the LoRA gradients over ranks (in place) and the step's scalars; every rank gets the sums."""
        params = trainable_parameters(model)
        for p in params:
            if p.grad is None:  # a rank without samples never ran backward: its share is zero
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])  # (total LoRA params,)
        dist.all_reduce(flat)  # SUM: each rank's loss was already divided by the step's totals
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (loss, sums, lag0, micro), group=self.commands)
        total: dict[str, float] = {}
        for _, s, _, _ in gathered:
            for k, v in s.items():
                total[k] = total.get(k, 0.0) + v
        return (
            sum(g[0] for g in gathered),
            total,
            (sum(g[2][0] for g in gathered), sum(g[2][1] for g in gathered)),
            sum(g[3] for g in gathered),
        )


def share(samples: list[Segment], runs: list[RunData], rank: int, world: int) -> list[Segment]:
    """The samples rank `rank` of `world` trains on: whole groups when there are at least `world` of
    them (their samples share a prompt, which a micro-batch runs once), else single samples; each unit
    to the rank with the fewest tokens so far, longest first (LPT). Every rank computes the same split.
    """
    group_of = {r.run_id: baseline_group(r) for r in runs}
    units: dict[Any, list[Segment]] = {}
    for s in samples:
        units.setdefault(group_of[s.run_id], []).append(s)
    parts = list(units.values()) if len(units) >= world else [[s] for s in samples]
    size = lambda part: sum(s.positions for s in part)  # noqa: E731
    ordered = sorted(range(len(parts)), key=lambda i: (-size(parts[i]), i))  # stable: ties by position
    load, owner = [0] * world, {}
    for i in ordered:
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += size(parts[i])
    return [s for i, part in enumerate(parts) if owner[i] == rank for s in part]


def init() -> Ranks:
    """Join the job torchrun started: NCCL on CUDA (one GPU per local rank), else gloo."""
    _die_with_parent()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    log.info("rank %d of %d on %s (%s)", rank, world, device, backend)
    return Ranks(rank, world, device, commands)


def _die_with_parent() -> None:
    # torchrun's agent tears the ranks down when one dies; when the agent itself is SIGKILLed, the
    # kernel does it (Linux): no rank may go on training, or publishing, alone
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the agent's teardown is all there is
        pass


def _signature(params: list[torch.nn.Parameter]) -> str:
    return hashlib.sha1(repr([tuple(p.shape) for p in params]).encode()).hexdigest()


class Leader:
    """Rank 0's side: `train_step` stands in for step.train_step in the TrainerService."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.model_path = ""  # the base model's folder, as the service loads it (set once it is known)

    def train_step(
        self,
        model: Any,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        runs: list[RunData],
        config: TrainerConfig,
        current_step: int = 0,
    ) -> Any:
        """One step over all ranks (the service's trainer thread calls it, like step.train_step)."""
        from rlproxy.trainer import step as step_module  # late: tests patch step.train_step

        params = trainable_parameters(model)
        command = {
            "op": "step",
            "policy": runs[0].policy if runs else "",
            "model_path": self.model_path,
            "runs": runs,
            "current_step": current_step,
            "signature": _signature(params),
        }
        try:
            dist.broadcast_object_list([command], src=0, group=self.ranks.commands)
            _broadcast_weights(params, self.ranks.device)
            result = step_module.train_step(
                model, tokenizer, optimizer, runs, config, current_step, ranks=self.ranks
            )
        except TrainerError:
            raise  # before any gradient collective, alike on every rank: they wait for the next command
        except BaseException:
            # a collective may be half done: the group cannot be trusted again. Stop this rank; torchrun
            # tears the others down, and a restart resumes from the last checkpoint (exactly once)
            log.critical("distributed step failed on rank 0; stopping the job", exc_info=True)
            os._exit(70)
        result.metrics["perf/ranks"] = float(self.ranks.world)
        return result

    def stop(self) -> None:
        """Tell the followers to exit (after the service stopped: no step is in flight)."""
        dist.broadcast_object_list([{"op": "stop"}], src=0, group=self.ranks.commands)


def follow(ranks: Ranks, config: TrainerConfig) -> None:
    """A follower's life: run rank 0's step commands on its share of each step, until told to stop."""
    # SIGTERM/SIGINT reach every rank; a follower exits when rank 0 says so, after the step in flight
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if config.train_threads:
        torch.set_num_threads(config.train_threads)
    models: dict[str, tuple[Any, Any, torch.optim.Optimizer]] = {}  # policy -> (model, tokenizer, optimizer)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=ranks.commands)
        command = box[0]
        if command["op"] == "stop":
            log.info("rank %d: stopped by rank 0", ranks.rank)
            return
        policy = command["policy"]
        held = models.get(policy)
        if held is None or _signature(trainable_parameters(held[0])) != command["signature"]:
            models.pop(policy, None)  # a policy's adapter shape is its first checkpoint's: load like rank 0
            last = ckpt.latest_checkpoint(config.checkpoint_dir, policy)
            model, tok = load_policy(command["model_path"], config, str(last.path) if last else None)
            if _signature(trainable_parameters(model)) != command["signature"]:
                raise TrainerError(f"rank {ranks.rank}: the adapter of {policy!r} differs from rank 0's")
            models[policy] = (model, tok, make_optimizer(model, config))
        model, tok, optimizer = models[policy]
        _broadcast_weights(trainable_parameters(model), ranks.device)
        try:
            train_step(model, tok, optimizer, command["runs"], config, command["current_step"], ranks=ranks)
        except TrainerError as exc:  # before any gradient collective, on rank 0 too
            log.info("rank %d: step not trained: %s", ranks.rank, exc)


def _broadcast_weights(params: list[torch.nn.Parameter], device: torch.device) -> None:
    """Rank 0's LoRA weights to every rank: the followers' copies are never trusted to have kept up."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).float() for p in params]).to(device)  # (total,)
        dist.broadcast(flat, src=0)
        offset = 0
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def shutdown() -> None:
    """Leave the process group (best effort: a peer may be gone)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway
            log.debug("destroy_process_group failed", exc_info=True)
