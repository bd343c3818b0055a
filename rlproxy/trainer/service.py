"""TrainerService: the background loop that turns ready groups into published adapters.

(Over 400 lines on purpose: train → save → load → commit → publish, plus crash recovery, is one
ordering contract, and keeping it in one file lets a reader check it top to bottom. Which runs a
step trains is selection.py's.)

    poll ──> the next step's runs (selection.py: ready groups, zero-variance ones skipped, or a batch
         of ungrouped runs with singletons=train; their completions)
         ──> [trainer thread] train_step ──> save checkpoint ──> backend.load_adapter("{policy}@{N}")
         ──> shadow check (shadow_prompts > 0: trainer/shadow.py; a step it stops commits rolled back)
         ──> commit (runs trained + training_steps row, one transaction) ──> on_publish(policy, N)
         ──> unload "{policy}@{N-K}" after unload_grace seconds

All torch work runs in ONE worker thread (a single-thread executor), so the event loop that serves
the proxy is never blocked by a forward pass, and steps never overlap.

Crash safety: the checkpoint is saved before the commit. A process that dies in between leaves a
checkpoint whose step the database does not know; the next start (and every poll) finds it and
commits it from its saved trainer state, exactly once, since the commit only succeeds while the
runs are still `completed`. A process that dies earlier leaves nothing: its runs stay `completed`
and are trained again from the last committed weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from rlproxy.inference.backend import Backend, SharesWeights, adapter_name
from rlproxy.omp import release_workers
from rlproxy.storage import rollouts as rollout_store
from rlproxy.storage import shadow as shadow_store
from rlproxy.storage.db import create_engine
from rlproxy.storage.errors import StepConflict
from rlproxy.storage.leader import LeaderLock
from rlproxy.storage.models import RunStatus
from rlproxy.storage.training import (
    RunData,
    StatusReason,
    commit_step,
    forget_adapter_paths,
    latest_step,
    mark_runs,
)
from rlproxy.trainer import checkpoint as ckpt
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.culprits import nonfinite_groups
from rlproxy.trainer.model import load_policy, pick_device, train_dtype
from rlproxy.trainer.publish import publish_step, unload_quietly
from rlproxy.trainer.reporting import MetricsReporter, parse_report_to, progress_line
from rlproxy.trainer.selection import Selection
from rlproxy.trainer.shadow import Outcome, ShadowPending
from rlproxy.trainer.step import StaleRuns, StepResult, make_optimizer, step_columns, train_step

log = logging.getLogger(__name__)
T = TypeVar("T")

NONFINITE_RETRIES = 3  # the same runs giving a non-finite step this many times in a row are marked failed
# Held from choosing a step number to committing it, by this service and by `rlproxy sft` (another
# process): two writers of one store never build the same step. A LeaderLock: a file lock next to a
# SQLite database, an advisory lock on PostgreSQL; a killed holder frees it.
STEPS_LOCK = "steps"


@dataclass
class Learner:
    """A policy's trainable state in memory: model + adapter, tokenizer, optimizer, and its step."""

    policy: str
    model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    step: int  # the step these weights are (0 = fresh adapter)


def resolved_config(config: TrainerConfig) -> dict[str, Any]:
    """The trainer's settings as JSON (only TrainerConfig fields: a Settings object may hold secrets)."""
    return {k: getattr(config, k) for k in TrainerConfig.model_fields}


def _then_release(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn` on the trainer thread, then that thread's OpenMP workers ended (omp.py): alive and idle
    between steps they slow the engine's decoding in this process ~1.5-2x."""
    try:
        return fn(*args, **kwargs)
    finally:
        release_workers()


class TrainerService:
    """Trains LoRA adapters from rewarded runs and publishes them to `backend`."""

    def __init__(
        self,
        config: TrainerConfig,
        db_url: str,
        backend: Backend,
        on_publish: Callable[[str, int], Awaitable[None]] | None = None,
        on_train_state: Callable[[bool], None] | None = None,
        judge: Any = None,
        train_fn: Callable[..., StepResult] | None = None,
        rollouts: Any = None,
        siblings_weight: float = 1.0,
        shadow: Any = None,
    ) -> None:
        self.config = config
        # step.train_step's stand-in, same signature: `rlproxy train --nproc N` runs a step on N ranks
        self.train_fn = train_fn
        self.judge = judge  # trainer/judge.py Judge: scores the groups waiting for it before each selection
        self.rollouts = rollouts  # trainer/rollout.py RolloutController (None: every policy immediate)
        self.shadow = shadow  # trainer/shadow.py ShadowChecker: a step's check before it serves (None: off)
        self.db_url = db_url
        self.backend = backend
        self.on_publish = on_publish
        self.on_train_state = on_train_state
        self._engine: Any = None
        # one trainer per store across the fleet: the holder of this lock (others stand by)
        self.leader = LeaderLock(db_url, "trainer", retry=config.poll_interval)
        self.steps_lock = LeaderLock(db_url, STEPS_LOCK, retry=config.poll_interval)
        self._steps_busy = False  # logged once while another process (rlproxy sft) holds steps_lock
        self._executor: ThreadPoolExecutor | None = None
        self._learners: dict[str, Learner] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one step (or recovery) at a time
        self._unloads: set[asyncio.Task[None]] = set()
        self.steps_done = 0
        self.steps_skipped = 0  # steps not taken: loss or gradient not finite
        self._nonfinite: dict[frozenset[str], int] = {}
        self.last_metrics: dict[str, Any] | None = None
        self.selection = Selection(config, self.db, judge, siblings_weight)  # the next step's runs
        # trackers named in report_to (a missing package is a ConfigError here, before serving starts)
        self.reporter = MetricsReporter(
            parse_report_to(config.report_to), config.metrics_log_dir, resolved_config(config)
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Take the leader lock, recover a step a crash left uncommitted, then poll for ready groups in
        the background. When another process holds the lock this one stands by (in the background) and
        takes over when that process dies (storage/leader.py)."""
        if await self.leader.try_acquire():
            log.info("leader: this process trains (%s)", self.leader.where)
            await self.recover()
            await self.selection.warn_singletons()
        self._task = asyncio.create_task(self._loop(), name="rlproxy-trainer")

    async def stop(self) -> None:
        """Stop polling; a step in progress finishes first (torch cannot be interrupted safely)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # until it has ended (its CancelledError stays in it)
            self._task = None
        async with self._lock:  # wait for a step_once called from elsewhere
            for t in list(self._unloads):
                t.cancel()
            if self._executor is not None:
                await asyncio.to_thread(self._executor.shutdown, wait=True)
                self._executor = None
            if self._engine is not None:
                await self._engine.dispose()
                self._engine = None
            if self.reporter:
                await asyncio.to_thread(self.reporter.close)
            if self.judge is not None:
                await self.judge.close()
            if self.shadow is not None:
                await self.shadow.close()
            await self.leader.release()

    async def _loop(self) -> None:
        while True:
            if not await self.leader.still_held():  # standby: wait for the leader to go, then recover
                self._learners.clear()  # the leader's steps moved the weights on: reload from checkpoints
                await self.leader.acquire()
                await self.recover()
                await self.selection.warn_singletons()
            try:
                metrics = await self.step_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("training step failed; trying again in %.1f s", self.config.poll_interval)
                metrics = None
            if metrics is None:
                await asyncio.sleep(self.config.poll_interval)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run torch work on the trainer thread (never on the event loop)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, "rlproxy-trainer", initializer=self._init_thread)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, partial(_then_release, fn, *args, **kwargs)
        )

    def _init_thread(self) -> None:
        if self.config.train_threads:
            torch.set_num_threads(self.config.train_threads)

    def db(self) -> Any:
        """The store (its engine, created on first use)."""
        if self._engine is None:
            self._engine = create_engine(self.db_url)
        return self._engine

    # ------------------------------------------------------------------ one step

    async def step_once(self) -> dict[str, Any] | None:
        """Train and publish one step if groups are ready; its metrics, or None when nothing was ready."""
        async with self._lock, self._steps_held() as held:
            if not held:  # another process builds a step (rlproxy sft): wait for its commit
                return None
            await self._recover_locked()
            engine = self.db()
            # canary rollouts: judge the open ones; a policy on trial trains again once it is decided
            on_trial = await self.rollouts.tick(self) if self.rollouts is not None else set()

            # 1. select: ready groups of one policy; zero-variance groups are skipped, not trained
            runs = await self.selection.runs()
            if not runs:
                return None
            policy = runs[0].policy
            if policy in on_trial or (self.shadow is not None and self.shadow.waiting(policy)):
                return None  # its next step waits for a verdict (canary, or a shadow check to retry)
            run_ids = [r.run_id for r in runs]
            learner = await self._learner(policy)
            db_step = await latest_step(engine, policy)
            if db_step > learner.step and self._newer_checkpoint(policy, learner.step):
                # another process moved the policy on (rlproxy sft): train its weights, not ours
                self._learners.pop(policy, None)
                learner = await self._learner(policy)
            step = max(learner.step, db_step) + 1
            started_at = datetime.now(UTC)
            t0 = time.perf_counter()

            # 2. train on the trainer thread (serving may be held meanwhile: on_train_state)
            self._train_state(True)
            try:
                result = await self._run(
                    self.train_fn or train_step,
                    learner.model,
                    learner.tokenizer,
                    learner.optimizer,
                    runs,
                    self.config,
                    learner.step,
                )
                if result.skipped:  # weights and optimizer untouched: nothing to save or publish
                    return await self._skipped(policy, run_ids, result, runs)
                result.metrics.update(self.selection.metrics(result))
                if self.selection.hosted_since:  # hosted runs seen since the last step: said, not dropped
                    result.metrics["data/hosted_runs_skipped"] = float(self.selection.hosted_since)
                # 3. checkpoint: adapter + optimizer + trainer state, atomically, before any publishing
                state = {
                    "run_ids": run_ids,
                    "num_groups": result.num_groups,
                    "num_tokens": result.num_tokens,
                    "mean_reward": result.mean_reward,
                    "loss": result.loss,
                    "metrics": result.metrics,
                    "config": resolved_config(self.config),
                    "started_at": started_at.isoformat(),
                }
                saved = await self._run(
                    ckpt.save_checkpoint,
                    self.config.checkpoint_dir,
                    policy,
                    step,
                    learner.model,
                    learner.optimizer,
                    state,
                )
            except StaleRuns as exc:
                n = await mark_runs(engine, run_ids, RunStatus.skipped, StatusReason.stale)
                log.warning("marked %d run(s) skipped: %s", n, exc)
                return None
            except BaseException:
                # the weights may be half-updated: the next step reloads the last checkpoint
                self._learners.pop(policy, None)
                raise
            finally:
                self._train_state(False)
            learner.step = step
            self._nonfinite.pop(frozenset(run_ids), None)

            # 4. publish: backend.load_adapter -> commit (exactly once) -> on_publish flips the alias
            result.metrics["perf/step_seconds"] = time.perf_counter() - t0
            try:
                await self._publish(saved, run_ids, result, started_at)
            except ShadowPending as exc:  # checkpoint kept, step uncommitted: the next poll's recovery
                log.warning("%s", exc)  # checks it again (trainer/shadow.py)
                return None
            self.selection.stepped()
            self._log_progress(policy, step, result, time.perf_counter() - t0)
            await self._report(policy, step, result)
            out = {"policy": policy, "step": step, "adapter_path": str(saved.path), **result.metrics}
            self.last_metrics = out
            self.steps_done += 1
            return out

    @asynccontextmanager
    async def _steps_held(self) -> AsyncIterator[bool]:
        """Hold STEPS_LOCK for one step (or recovery); yields False, holding nothing, while another
        process holds it."""
        held = await self.steps_lock.try_acquire()
        if held != (not self._steps_busy):
            self._steps_busy = not held
            log.info(
                "another process builds a step (rlproxy sft): training waits"
                if not held
                else "steps lock free again"
            )
        try:
            yield held
        finally:
            if held:
                await self.steps_lock.release()

    def _newer_checkpoint(self, policy: str, step: int) -> bool:
        last = ckpt.latest_checkpoint(self.config.checkpoint_dir, policy)
        return last is not None and last.step > step

    async def _skipped(
        self, policy: str, run_ids: list[str], result: StepResult, runs: list[RunData] | None = None
    ) -> None:
        """A step with a non-finite loss or gradient: counted and logged; its runs stay trainable,
        unless the same runs failed NONFINITE_RETRIES times in a row (then `failed`, so they cannot
        block the queue): only the groups that carry the cause, when the data shows one (culprits.py)."""
        self.steps_skipped += 1
        self.last_metrics = {"policy": policy, "step": None, **result.metrics}
        key = frozenset(run_ids)
        tries = self._nonfinite[key] = self._nonfinite.get(key, 0) + 1
        if tries >= NONFINITE_RETRIES:
            self._nonfinite.pop(key)
            culprits = nonfinite_groups(runs or []) or set(run_ids)  # issue 22: not the other groups
            n = await mark_runs(self.db(), sorted(culprits), RunStatus.failed, StatusReason.nonfinite)
            log.warning(
                "marked %d run(s) failed: %d non-finite steps in a row; %d other run(s) stay trainable",
                n,
                tries,
                len(set(run_ids) - culprits),
            )
        else:
            log.warning(
                "%s: step skipped (%d so far): loss %s, grad norm %s not finite; %d run(s) stay trainable",
                policy,
                self.steps_skipped,
                result.metrics.get("loss/total"),
                result.metrics.get("loss/grad_norm"),
                len(run_ids),
            )
        return None

    async def _learner(self, policy: str) -> Learner:
        if policy not in self._learners:
            base = await self._shared_base()
            self._learners[policy] = await self._run(self._load_learner, policy, base)
        return self._learners[policy]

    async def _shared_base(self) -> Any:
        """The embedded engine's base weights for this trainer's LoRA (one copy in memory), or None:
        not asked, another process's model (vLLM), or another device or dtype than training wants."""
        if not self.config.share_base_weights or not isinstance(self.backend, SharesWeights):
            return None
        base = await self.backend.shared_base()
        weight = next(base.parameters())
        device = pick_device()
        if weight.device.type != device.type or weight.dtype != train_dtype(device):
            log.info("base weights not shared: the engine's are %s on %s", weight.dtype, weight.device)
            return None
        log.info("the trainer shares the engine's base weights (one copy in memory)")
        return base

    def _load_learner(self, policy: str, base: Any = None) -> Learner:
        last = ckpt.latest_checkpoint(self.config.checkpoint_dir, policy)
        path = str(last.path) if last else None
        model, tokenizer = load_policy(self.backend.model_path, self.config, path, base=base)
        optimizer = make_optimizer(model, self.config)
        if last is not None:
            ckpt.load_optimizer(last, optimizer)
            log.info("resumed policy %r from %s", policy, last.path)
        return Learner(policy, model, tokenizer, optimizer, last.step if last else 0)

    def _train_state(self, training: bool) -> None:
        if self.on_train_state is not None:
            try:
                self.on_train_state(training)
            except Exception:
                log.exception("on_train_state(%s) failed", training)

    async def _publish(
        self,
        saved: ckpt.Checkpoint,
        run_ids: list[str],
        result: StepResult,
        started_at: datetime | None,
        kind: str = "grpo",
    ) -> None:
        """Through the one door (trainer/publish.py): load into every replica, commit (exactly once),
        flip the alias, prune; then the adapter keep_checkpoints steps back is unloaded after
        unload_grace seconds."""
        policy, step = saved.policy, saved.step
        rollout = None
        shadow: Outcome | None = None

        async def commit() -> bool:
            nonlocal rollout, shadow
            # the shadow check: the adapter is loaded, nobody is served by it yet (ShadowPending: no
            # verdict, the step waits uncommitted); a step it stops commits with its rollback row first
            if self.shadow is not None:
                shadow = await self.shadow.check(self.db(), policy, step, run_ids)
                if not shadow.serves:
                    reason = f"shadow: {shadow.reason}"
                    await shadow_store.reject_step(
                        self.db(), policy=policy, step=step, serving=shadow.serving_step, reason=reason
                    )
            # a canary policy's rollout row exists before its step does (trainer/rollout.py)
            if self.rollouts is not None and (shadow is None or shadow.serves):
                rollout = await self.rollouts.begin(self.db(), policy, step)
            await commit_step(
                self.db(), policy=policy, step=step, run_ids=run_ids, adapter_path=str(saved.path),
                started_at=started_at, num_groups=result.num_groups, num_tokens=result.num_tokens,
                mean_reward=result.mean_reward, loss=result.loss, metrics=result.metrics,
                config=resolved_config(self.config), run_segments=result.run_segments,
                columns={**step_columns(result.metrics), "kind": kind},
            )  # fmt: skip
            return shadow is None or shadow.serves

        try:
            await publish_step(
                saved,
                commit,
                engine=self.db(),
                config=self.config,
                backend=self.backend,
                on_publish=self.on_publish,
                # the step belongs to nobody: forget its weights and its adapter, keep the last committed
                # ones; any other failure keeps the checkpoint for recovery
                discard_on=StepConflict,
                keep=self._serving(policy),
            )
        except StepConflict:
            if self.rollouts is not None and rollout is not None:
                await self.rollouts.abort(self.db(), rollout)
            self._learners.pop(policy, None)
            raise
        if shadow is not None and not shadow.serves:  # committed rolled back: never served
            log.warning("%s@%d rolled back by the shadow check: %s", policy, step, shadow.reason)
            await self.discard_rolled_back()
            return
        serving = await self.rollouts.protect(self.db(), policy) if self.rollouts is not None else ()
        old = step - self.config.keep_checkpoints
        if old >= 1 and old not in serving:  # a canary's incumbent stays loaded (trainer/rollout.py)
            task = asyncio.create_task(
                unload_quietly(self.backend, adapter_name(policy, old), self.config.unload_grace)
            )
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    def _serving(self, policy: str) -> Callable[[], Awaitable[tuple[int, ...]]] | None:
        """The steps a canary keeps serving besides the newest (its incumbent): never pruned."""
        if self.rollouts is None:
            return None
        rollouts = self.rollouts

        async def serving() -> tuple[int, ...]:
            return tuple(await rollouts.protect(self.db(), policy))

        return serving

    # ------------------------------------------------------------------ recovery

    async def recover(self) -> list[tuple[str, int]]:
        """Commit checkpoints whose step the database lacks (a crash between save and commit)."""
        async with self._lock, self._steps_held() as held:
            return await self._recover_locked() if held else []

    async def _recover_locked(self) -> list[tuple[str, int]]:
        root = self.config.checkpoint_dir
        await asyncio.to_thread(ckpt.clean_partial, root)
        # a rolled-back step whose checkpoint a crash left (no learner may resume from it, in any mode)
        await self.discard_rolled_back()
        done = []
        for policy in await asyncio.to_thread(ckpt.checkpoint_policies, root):
            last = ckpt.latest_checkpoint(root, policy)
            db_step = await latest_step(self.db(), policy)
            if self.shadow is not None:
                self.shadow.settled(policy, last.step if last is not None and last.step > db_step else None)
            if last is None or last.step <= db_step:
                continue
            if self.shadow is not None and self.shadow.retry_in(policy, last.step):
                continue  # its shadow check had no verdict: tried again (and re-loaded) when it is due
            if last.step != db_step + 1:
                log.warning(
                    "checkpoints of %r reach step %d but the database only step %d (another database?); "
                    "resuming the weights, not committing",
                    policy,
                    last.step,
                    db_step,
                )
                continue
            state = last.state()
            started = state.get("started_at")
            result = StepResult(
                num_groups=state.get("num_groups") or 0,
                num_runs=len(state["run_ids"]),
                num_tokens=state.get("num_tokens") or 0,
                mean_reward=state.get("mean_reward") or 0.0,
                loss=state.get("loss") or 0.0,
                metrics=state.get("metrics") or {},
            )
            try:
                await self._publish(
                    last,
                    state["run_ids"],
                    result,
                    datetime.fromisoformat(started) if started else None,
                    state.get("kind", "grpo"),  # an `rlproxy sft` step a crash left uncommitted stays sft
                )
            except StepConflict as exc:
                log.warning("discarded uncommitted checkpoint %s: %s", last.path, exc)
                continue
            except ShadowPending as exc:  # its check has no verdict yet: the next poll tries again
                log.warning("%s", exc)
                continue
            log.info(
                "recovered step %d of %r from its checkpoint (saved, not committed before a restart)",
                last.step,
                policy,
            )
            done.append((policy, last.step))
        return done

    async def discard_rolled_back(self) -> list[tuple[str, int]]:
        """Delete the checkpoints of rolled-back steps (a canary's or the shadow check's), forget their
        paths, drop a learner holding their weights and unload their adapters (idempotent: a crash in
        between is finished next time); the (policy, step) cleaned."""
        engine = self.db()
        done = []
        for policy, step, path in await rollout_store.rolled_back_adapters(engine):
            await asyncio.to_thread(ckpt.discard, ckpt.Checkpoint(policy, step, Path(path)))
            await forget_adapter_paths(engine, policy, [step])
            learner = self._learners.get(policy)
            if learner is not None and learner.step == step:
                self._learners.pop(policy, None)  # the next step starts from the incumbent's checkpoint
            task = asyncio.create_task(
                unload_quietly(self.backend, adapter_name(policy, step), self.config.unload_grace)
            )
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)
            log.info("rolled back %s@%d: checkpoint %s deleted, adapter unloaded", policy, step, path)
            done.append((policy, step))
        return done

    # ------------------------------------------------------------------ feedback

    def _log_progress(self, policy: str, step: int, r: StepResult, seconds: float) -> None:
        log.info("%s", progress_line(policy, step, r, seconds))

    async def _report(self, policy: str, step: int, r: StepResult) -> None:
        """The step's metrics to the trackers of `report_to` (file/network I/O: off the event loop)."""
        if self.reporter:
            metrics = {**r.metrics, "reward/mean": r.mean_reward, "loss/total": r.loss}
            await asyncio.to_thread(self.reporter.log, policy, step, metrics)
