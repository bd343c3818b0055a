"""Steps made by a command rather than by the trainer loop: SFT, fork, and a start from a LoRA folder.

    rlproxy sft  --policy P ...      -> step N+1 of P, kind `sft` (trainer/sft.py does the math)
    rlproxy fork P@N NEW             -> step 1 of NEW, kind `fork`: a copy of P@N's checkpoint
    --init-adapter DIR (serve/train) -> step 1 of each policy without steps, kind `init`: DIR's LoRA

Each one takes the store's steps lock (service.STEPS_LOCK, also held by every trainer step), writes
its checkpoint atomically, loads it into `backend` when there is one (`--upstream`; `serve` passes
its own), and commits its `training_steps` row (and, for fork and init, the `policies` row: migration
0007). A running `serve` on the same store serves the new step within `policy_poll_interval`
(proxy/policies.py: it loads the adapter from the checkpoint folder, then flips the alias), so
`checkpoint_dir` must be the same folder for both.

(Over 400 lines by a few: the three kinds of step share one order (lock, checkpoint, load, commit)
and `publish.publish_step`.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from rlproxy.errors import ConfigError, TrainerError
from rlproxy.inference.backend import Backend, parse_adapter_name
from rlproxy.storage.db import create_engine
from rlproxy.storage.export import select_run_ids
from rlproxy.storage.leader import LeaderLock
from rlproxy.storage.lineage import PolicyExists, start_policy, step_adapter
from rlproxy.storage.queries import open_readonly
from rlproxy.storage.training import commit_step, latest_step, load_runs
from rlproxy.trainer import checkpoint as ckpt
from rlproxy.trainer import sft
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.model import load_policy
from rlproxy.trainer.publish import publish_step
from rlproxy.trainer.service import STEPS_LOCK, resolved_config
from rlproxy.trainer.sft import train_sft
from rlproxy.trainer.step import make_optimizer, step_columns

log = logging.getLogger(__name__)


async def _steps_lock(db_url: str, retry: float = 0.5) -> LeaderLock:
    """The store's steps lock, held (waits while a trainer step or another command holds it)."""
    lock = LeaderLock(db_url, STEPS_LOCK, retry=retry)
    if not await lock.try_acquire():
        log.info("waiting for the step in progress to commit (%s)", lock.where)
        while not await lock.try_acquire():
            await asyncio.sleep(retry)
    return lock


# ---------------------------------------------------------------------------------------- adapters


def validate_adapter(adapter_dir: str | Path, model_path: str | Path, max_lora_rank: int) -> dict[str, Any]:
    """The peft config of the LoRA folder `adapter_dir`, checked against the base model at `model_path`:
    a LoRA, of rank <= max_lora_rank, whose weights fit the base model's layers. ConfigError otherwise."""
    folder = Path(adapter_dir)
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{folder} is not a LoRA adapter folder: no adapter_config.json (peft's format)")
    cfg = json.loads(cfg_file.read_text())
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise ConfigError(f"{folder}: peft_type {cfg.get('peft_type')!r}, expected LORA")
    rank = int(cfg.get("r") or 0)
    if rank > max_lora_rank:
        raise ConfigError(f"{folder}: LoRA rank {rank} > max_lora_rank {max_lora_rank} (raise max_lora_rank)")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{folder}: no adapter_model.safetensors")
    base = _base_shapes(Path(model_path))
    if base:
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            for key in f.keys():
                if ".lora_A." not in key and ".lora_B." not in key:
                    continue
                module = key.split(".lora_")[0].removeprefix("base_model.model.")
                shape = base.get(f"{module}.weight")
                lora = f.get_slice(key).get_shape()
                fits = shape is not None and (
                    lora[1] == shape[1] if ".lora_A." in key else lora[0] == shape[0]
                )
                if not fits:
                    raise ConfigError(
                        f"{folder} does not fit the base model {model_path}: {key} has shape {list(lora)}, "
                        f"the base layer {module} {list(shape) if shape else 'does not exist'} "
                        "(an adapter trained on another model?)"
                    )
    return cfg


def _base_shapes(model_path: Path) -> dict[str, list[int]]:
    """Weight name -> shape of the base model's safetensors files ({} when it has none to read)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(model_path.glob("*.safetensors")) if model_path.is_dir() else []:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                shapes[key] = list(f.get_slice(key).get_shape())
    return shapes


async def _start(
    db_url: str,
    config: TrainerConfig,
    policy: str,
    src: Path,
    *,
    kind: str,
    backend: Backend | None = None,
    parent: str | None = None,
    parent_step: int | None = None,
    init_adapter: str | None = None,
) -> ckpt.Checkpoint:
    """Step 1 of a new `policy`: a copy of the adapter folder `src`, loaded, recorded (fork or init)."""
    engine = create_engine(db_url)
    lock = await _steps_lock(db_url)
    try:
        if await latest_step(engine, policy) > 0:
            raise PolicyExists(f"policy {policy!r} already has steps; pick a new name")
        origin = {"parent": parent, "parent_step": parent_step, "init_adapter": init_adapter}
        state = {"kind": kind, "run_ids": [], "config": resolved_config(config), **origin}
        saved = await asyncio.to_thread(ckpt.copy_checkpoint, src, config.checkpoint_dir, policy, 1, state)

        async def commit() -> None:
            await start_policy(
                engine,
                policy=policy,
                kind=kind,
                adapter_path=str(saved.path),
                config=state["config"],
                **origin,
            )

        await publish_step(saved, commit, engine=engine, config=config, backend=backend, prune=False)
        return saved
    finally:
        await lock.release()
        await engine.dispose()


async def fork_policy(
    db_url: str, config: TrainerConfig, source: str, new_policy: str, backend: Backend | None = None
) -> ckpt.Checkpoint:
    """`rlproxy fork POLICY@N NEW`: NEW's step 1 is POLICY's step N (adapter and optimizer state)."""
    parsed = parse_adapter_name(source)
    if parsed is None or parsed[1] < 1:
        raise ConfigError(f"{source!r}: name a step as POLICY@N (N >= 1; `rlproxy steps` lists them)")
    parent, step = parsed
    if new_policy == parent or parse_adapter_name(new_policy) is not None or not new_policy.strip():
        raise ConfigError(f"{new_policy!r}: the new policy needs a new name without @")
    engine = create_engine(db_url)
    try:
        recorded, path = await step_adapter(engine, parent, step)
    finally:
        await engine.dispose()
    if not recorded:
        raise ConfigError(f"policy {parent!r} has no step {step} (`rlproxy steps --policy {parent}`)")
    if path is None or not (Path(path) / "adapter_config.json").is_file():
        where = f": {path}" if path else ""  # a pruned step's adapter_path is NULL
        raise ConfigError(
            f"the checkpoint of {source} is gone (pruned by keep_checkpoints; `rlproxy steps` shows the "
            f"kept ones){where}"
        )
    return await _start(
        db_url, config, new_policy, Path(path), kind="fork", backend=backend, parent=parent, parent_step=step
    )


async def init_policies(
    db_url: str,
    config: TrainerConfig,
    policies: list[str],
    adapter_dir: str,
    model_path: str,
    max_lora_rank: int,
    backend: Backend | None = None,
) -> list[str]:
    """`--init-adapter DIR`: each of `policies` without a step starts from DIR (step 1, kind init);
    policies with steps keep them. Returns the policies started."""
    await asyncio.to_thread(validate_adapter, adapter_dir, model_path, max_lora_rank)
    engine = create_engine(db_url)
    try:
        fresh = [p for p in dict.fromkeys(policies) if await latest_step(engine, p) == 0]
    finally:
        await engine.dispose()
    started = []
    for policy in fresh:
        try:
            await _start(
                db_url,
                config,
                policy,
                Path(adapter_dir),
                kind="init",
                backend=backend,
                init_adapter=adapter_dir,
            )
        except PolicyExists:  # another replica started it first
            continue
        started.append(policy)
    for policy in set(policies) - set(fresh):
        log.info("policy %s has steps: --init-adapter leaves it as it is", policy)
    return started


# --------------------------------------------------------------------------------------------- SFT


def sft_condition(
    where: str | None,
    from_policy: str | None,
    min_reward: float | None,
    include_val: bool,
    from_source: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """The SQL condition (and its parameters) selecting the runs SFT learns from, for
    `storage.export.select_run_ids`: validation runs stay held out unless `include_val`.
    `from_source` keeps runs with calls of that `completions.source` (import, hosted)."""
    filters = [] if include_val else ["split = 'train'"]
    params: dict[str, Any] = {}
    if from_policy is not None:
        filters.append("policy = :from_policy")
        params["from_policy"] = from_policy
    if from_source is not None:
        filters.append("run_id IN (SELECT run_id FROM completions WHERE source = :from_source)")
        params["from_source"] = from_source
    if min_reward is not None:
        filters.append("reward >= :min_reward")
        params["min_reward"] = min_reward
    if where is not None:
        filters.append(f"({where})")
    return " AND ".join(filters), params


async def sft_examples(
    db_url: str,
    tokenizer: Any,
    *,
    where: str | None,
    file: str | None,
    from_policy: str | None = None,
    min_reward: float | None = None,
    include_val: bool = False,
    from_source: str | None = None,
) -> list[Any]:
    """The examples of `rlproxy sft`: the runs `where` selects (exact tokens), the chats of `file`,
    or (`from_policy`, `from_source`) the conversations of that policy's or source's runs rendered
    with the student's template (distillation: a hosted teacher's or an imported trace's rows have no
    tokens). Runs of split `val` are left out unless `include_val`; `min_reward` keeps only runs
    rewarded at least that."""
    if file is not None:
        if where is not None or from_policy is not None or from_source is not None or min_reward is not None:
            raise ConfigError(
                "--file takes no --where, --from-policy or --min-reward (they select stored runs)"
            )
        return [sft.chat_example(tokenizer, c["messages"], c.get("tools")) for c in sft.read_chats(file)]
    if where is None and from_policy is None and from_source is None:
        raise ConfigError("give one of --where (SQL over the trajectories view) and --file (chat JSONL)")

    condition, params = sft_condition(where, from_policy, min_reward, include_val, from_source)
    engine = await open_readonly(db_url)  # `where` is the operator's SQL: it may read, never write
    try:
        # `where` reads the runs' columns too (split, policy, ...), as `rlproxy export --where` does
        ids = await select_run_ids(engine, condition, params)
        runs = await load_runs(engine, ids) if ids else []
    finally:
        await engine.dispose()
    what = " ".join(
        f"{k} {v!r}"
        for k, v in (("--from-policy", from_policy), ("--from-source", from_source), ("--where", where))
        if v is not None
    )
    if from_policy is not None or from_source is not None:
        examples, _ = sft.distill_examples(tokenizer, runs)
        if not examples:
            raise ConfigError(f"{what} selects {len(ids)} train run(s) with no conversation to learn")
        log.info("distilling %d conversation(s) of %d run(s) (%s)", len(examples), len(runs), what)
        return examples
    examples = sft.run_examples(runs)
    if not examples:
        raise ConfigError(f"{what} selects {len(ids)} train run(s) with no stored tokens to learn")
    log.info("SFT on %d completion(s) of %d run(s)", len(examples), len(runs))
    return examples


async def run_sft(
    db_url: str,
    config: TrainerConfig,
    model_path: str,
    policy: str,
    *,
    where: str | None = None,
    file: str | None = None,
    epochs: int = 1,
    batch_size: int = 16,
    backend: Backend | None = None,
    from_policy: str | None = None,
    min_reward: float | None = None,
    into: str | None = None,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
    include_val: bool = False,
    from_source: str | None = None,
) -> dict[str, Any]:
    """`rlproxy sft`: train the policy's newest adapter on the examples, publish it as the next step.

    `into` NEW: publish as step 1 of a new policy NEW instead (the policy's traffic stays where it is
    until the user routes an app to NEW: the model map). `on_step(done, total, metrics)`: progress."""
    engine = create_engine(db_url)
    lock = await _steps_lock(db_url)
    try:
        # 1. the weights to continue: the newest committed step's checkpoint (or a fresh adapter)
        db_step = await latest_step(engine, policy)
        last = ckpt.latest_checkpoint(config.checkpoint_dir, policy)
        if db_step > 0 and (last is None or last.step != db_step):
            raise TrainerError(
                f"policy {policy!r} is at step {db_step} but its newest checkpoint in "
                f"{config.checkpoint_dir} is {last.step if last else 'none'}: the trainer's checkpoint_dir? "
                "(a crash leaves a step that the next `serve`/`train` start commits)"
            )
        model, tokenizer = await asyncio.to_thread(
            load_policy, model_path, config, str(last.path) if last else None
        )
        optimizer = make_optimizer(model, config)
        if last is not None:
            ckpt.load_optimizer(last, optimizer)
        examples = await sft_examples(
            db_url,
            tokenizer,
            where=where,
            file=file,
            from_policy=from_policy,
            min_reward=min_reward,
            include_val=include_val,
            from_source=from_source,
        )
        target = into or policy
        if into is not None and into != policy:
            if parse_adapter_name(into) is not None or not into.strip():
                raise ConfigError(f"{into!r}: the new policy needs a name without @")
            if await latest_step(engine, into) > 0:
                raise ConfigError(f"policy {into!r} already has steps; pick a new name for --into")
        started_at = datetime.now(UTC)

        # 2. train: epochs over the examples (torch, off the event loop)
        def train() -> Any:
            if config.train_threads:  # torch's thread count is per thread: set it where the work runs
                torch.set_num_threads(config.train_threads)
            return train_sft(
                model,
                tokenizer,
                optimizer,
                examples,
                config,
                epochs=epochs,
                batch_size=batch_size,
                seed=config.seed,
                on_step=on_step,
            )

        result = await asyncio.to_thread(train)
        if result.metrics["step/skipped_nonfinite"]:
            raise TrainerError("an SFT optimizer step had a non-finite loss or gradient: nothing published")

        # 3. checkpoint (publish_step below then loads it, commits it, prunes: as a trainer step does)
        step = db_step + 1 if target == policy else 1
        source = {
            "sft_where": where,
            "sft_file": file,
            "sft_epochs": epochs,
            "sft_batch_size": batch_size,
            "sft_from_policy": from_policy,
            "sft_from_source": from_source,
            "sft_min_reward": min_reward,
            "sft_parent": f"{policy}@{db_step}" if target != policy else None,
        }
        state = {
            "kind": "sft",
            "run_ids": [],
            "num_tokens": result.num_tokens,
            "loss": result.loss,
            "metrics": result.metrics,
            "config": {**resolved_config(config), **source},
            "started_at": started_at.isoformat(),
        }
        saved = await asyncio.to_thread(
            ckpt.save_checkpoint, config.checkpoint_dir, target, step, model, optimizer, state
        )

        async def commit() -> None:
            await commit_step(
                engine,
                policy=target,
                step=step,
                run_ids=[],
                adapter_path=str(saved.path),
                started_at=started_at,
                num_groups=0,
                num_tokens=result.num_tokens,
                loss=result.loss,
                metrics=result.metrics,
                config=state["config"],
                columns={**step_columns(result.metrics), "kind": "sft"},
            )

        # 4. through the one door: load, commit, prune like a trainer step (the best checkpoint stays)
        await publish_step(saved, commit, engine=engine, config=config, backend=backend)
        log.info(
            "SFT step %d of %s: loss %.4f over %d examples", step, target, result.loss, result.num_examples
        )
        return {"policy": target, "step": step, "adapter_path": str(saved.path), **result.metrics}
    finally:
        await lock.release()
        await engine.dispose()
