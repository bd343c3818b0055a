"""The one door a new step goes through to be served: load into every replica -> commit -> flip -> prune.

    saved checkpoint (caller: trainer step, `rlproxy sft`, fork, --init-adapter, crash recovery)
      ──> backend.load_adapter("{policy}@{N}")   every replica (vLLM) or the in-process engine
      ──> commit()                               the step's row in SQL (training_steps / policies)
      ──> on_publish(policy, N)                  the proxy's alias flips: new requests get step N
      ──> prune                                  all but the newest keep_checkpoints (and the best)

Saving is the caller's, since recovery publishes a checkpoint a crashed process saved. The order is
the contract: the alias never names an adapter a replica lacks, and the commit (exactly once) comes
after the load, so a step the database knows is always servable. A commit that fails with one of
`discard_on` leaves nothing behind: its checkpoint folder is deleted and its adapter unloaded; any
other failure keeps the checkpoint for the next start to recover (trainer/service.py `recover`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rlproxy.errors import AdapterError
from rlproxy.inference.backend import Backend, adapter_name
from rlproxy.storage.training import forget_adapter_paths
from rlproxy.storage.validation import best_step
from rlproxy.trainer import checkpoint as ckpt
from rlproxy.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


async def publish_step(
    saved: ckpt.Checkpoint,
    commit: Callable[[], Awaitable[Any]],
    *,
    engine: Any,
    config: TrainerConfig,
    backend: Backend | None = None,
    on_publish: Callable[[str, int], Awaitable[None]] | None = None,
    discard_on: type[BaseException] | tuple[type[BaseException], ...] = BaseException,
    prune: bool = True,
    keep: Callable[[], Awaitable[Sequence[int]]] | None = None,
) -> list[int]:
    """Serve checkpoint `saved` (load into `backend`, commit, flip, prune); the steps pruned.

    `backend` None: no server to load into (`rlproxy sft` without `--upstream`); a running `serve`
    on the same store loads it from the folder within policy_poll_interval (proxy/policies.py).
    `commit` writes the step's row(s); when it raises one of `discard_on` the step belongs to nobody:
    its folder and adapter go, and the exception propagates. When it returns False the step was
    committed as rejected (the shadow check stopped it: trainer/shadow.py): no flip, no pruning; the
    caller discards it. `keep` names more steps that must stay
    on disk (a canary's incumbent, trainer/rollout.py), asked after the flip."""
    policy, step = saved.policy, saved.step
    name = adapter_name(policy, step)
    loaded = False
    try:
        if backend is not None:
            await backend.load_adapter(name, str(saved.path))
            loaded = True
        served = await commit()
    except discard_on:
        ckpt.discard(saved)
        if loaded:
            await unload_quietly(backend, name)
        raise
    if served is False:
        return []
    if on_publish is not None:
        await on_publish(policy, step)
    if not prune:
        return []
    # deleting old checkpoint folders is disk work: off the event loop; their rows then name no folder;
    # the best adapter by validation reward stays too (keep_best; storage/validation.py)
    best = await best_step(engine, policy, min_runs=config.val_min_runs)
    protect = (best,) if best is not None and config.keep_best else ()
    if keep is not None:
        protect = (*protect, *await keep())
    pruned = await asyncio.to_thread(
        ckpt.prune, config.checkpoint_dir, policy, config.keep_checkpoints, protect
    )
    await forget_adapter_paths(engine, policy, pruned)
    return pruned


async def unload_quietly(backend: Backend | None, name: str, delay: float = 0.0) -> None:
    """Unload adapter `name` after `delay` seconds (in-flight requests on it finish first); an adapter
    already gone is fine, any other failure is logged (a stale adapter costs memory, not correctness)."""
    if backend is None:
        return
    await asyncio.sleep(delay)
    try:
        await backend.unload_adapter(name)
    except AdapterError as exc:
        if exc.status != 404:
            log.warning("could not unload adapter %s: %s", name, exc)
    except Exception as exc:  # noqa: BLE001 - backend down: nothing to free
        log.warning("could not unload adapter %s: %s", name, exc)
