"""Checkpoints: `{checkpoint_dir}/{policy}/step-{N:04d}/`, each complete or absent.

A checkpoint folder holds the LoRA adapter as peft saves it (`adapter_config.json`,
`adapter_model.safetensors`: vLLM's `/v1/load_lora_adapter` and the embedded engine load the folder
as is), `optimizer.pt` (AdamW's moments, so a resumed run continues the same optimization) and
`trainer_state.json` (step, the run ids it trained, its metrics and the resolved config: enough to
commit the step to the database if the process died between saving and committing).

It is written in a temporary folder next to its final place and renamed into it: rename is atomic
on one file system, so a crash leaves either a complete checkpoint or a `.tmp-*` folder that the
next start deletes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlproxy.errors import TrainerError

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
_STEP_DIR = re.compile(r"^step-(\d{4,})$")


@dataclass
class Checkpoint:
    """A complete checkpoint on disk."""

    policy: str
    step: int
    path: Path

    def state(self) -> dict[str, Any]:
        """The trainer state saved with it."""
        return json.loads((self.path / STATE_FILE).read_text())


def policy_dir(root: str | Path, policy: str) -> Path:
    """Folder of a policy's checkpoints; the name is made file-system safe (`org/model` -> `org_model`).
    TrainerError for a name that would be no folder of its own under `root` (`.`, `..`, empty)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", policy)
    if name in ("", ".", ".."):
        raise TrainerError(f"policy name {policy!r} names no folder under the checkpoint folder")
    return Path(root) / name


def step_dir(root: str | Path, policy: str, step: int) -> Path:
    return policy_dir(root, policy) / f"step-{step:04d}"


def _fsync_tree(folder: Path) -> None:
    # the rename is only durable once the files it points at are on disk
    for p in folder.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _write_step(
    root: str | Path, policy: str, step: int, state: dict[str, Any], fill: Callable[[Path], None]
) -> Checkpoint:
    """Checkpoint `step` of `policy`, atomically: `fill` writes the adapter into a temporary folder,
    then `state` and a rename. Fails if that step already exists."""
    final = step_dir(root, policy, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        raise TrainerError(f"checkpoint {final} already exists; refusing to overwrite a published adapter")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:04d}-", dir=final.parent))
    try:
        fill(tmp)
        state = {**state, "policy": policy, "step": step}
        # STATE_FILE last: a folder with it is complete even before the rename (belt and braces)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, default=str))
        _fsync_tree(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.debug("saved checkpoint %s", final)
    return Checkpoint(policy, step, final)


def save_checkpoint(
    root: str | Path,
    policy: str,
    step: int,
    model: Any,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
) -> Checkpoint:
    """Write checkpoint `step` of `policy` atomically; returns it. Fails if that step already exists."""

    def fill(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)

    return _write_step(root, policy, step, state, fill)


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", OPTIMIZER_FILE)


def copy_checkpoint(
    src: str | Path, root: str | Path, policy: str, step: int, state: dict[str, Any]
) -> Checkpoint:
    """Checkpoint `step` of `policy` made from the adapter folder `src` (a fork's or `--init-adapter`'s):
    its adapter files (and optimizer.pt when there is one) plus `state`, written atomically like
    `save_checkpoint`. Fails if that step already exists."""

    def fill(tmp: Path) -> None:
        for name in ADAPTER_FILES:
            if (Path(src) / name).is_file():
                shutil.copy2(Path(src) / name, tmp / name)

    return _write_step(root, policy, step, state, fill)


def list_checkpoints(root: str | Path, policy: str) -> list[Checkpoint]:
    """The complete checkpoints of `policy`, oldest first."""
    folder = policy_dir(root, policy)
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            out.append(Checkpoint(policy, int(m.group(1)), p))
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(root: str | Path, policy: str) -> Checkpoint | None:
    """The newest complete checkpoint of `policy`, or None."""
    found = list_checkpoints(root, policy)
    return found[-1] if found else None


def checkpoint_policies(root: str | Path) -> list[str]:
    """Policies with at least one complete checkpoint under `root` (names as saved in their state)."""
    root = Path(root)
    if not root.is_dir():
        return []
    policies = []
    for d in sorted(root.iterdir()):
        steps = [p for p in d.glob("step-*") if (p / STATE_FILE).is_file()] if d.is_dir() else []
        if steps:
            policies.append(json.loads((sorted(steps)[-1] / STATE_FILE).read_text())["policy"])
    return policies


def clean_partial(root: str | Path) -> int:
    """Delete `.tmp-*` folders a crash left behind; returns how many."""
    root = Path(root)
    n = 0
    if root.is_dir():
        for tmp in root.glob("*/.tmp-step-*"):
            shutil.rmtree(tmp, ignore_errors=True)
            n += 1
    return n


def prune(root: str | Path, policy: str, keep: int, protect: Collection[int] = ()) -> list[int]:
    """Delete all but the newest `keep` checkpoints of `policy` and the steps in `protect` (the best one
    by validation reward: storage/validation.py); returns the deleted steps."""
    found = list_checkpoints(root, policy)
    gone = [c for c in found[: max(len(found) - keep, 0)] if c.step not in protect]
    for c in gone:
        shutil.rmtree(c.path, ignore_errors=True)
    return [c.step for c in gone]


def discard(checkpoint: Checkpoint) -> None:
    """Remove a checkpoint that was never committed (its step belongs to nobody)."""
    shutil.rmtree(checkpoint.path, ignore_errors=True)


def load_optimizer(checkpoint: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
    """Restore AdamW's moments saved with `checkpoint` (if present), keeping `optimizer`'s hyperparameters.

    `load_state_dict` would also bring back the checkpoint's learning rate and weight decay; a restart
    with new settings must train with them (they are what the step rows record).
    """
    f = checkpoint.path / OPTIMIZER_FILE
    if f.is_file():
        current = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))
        for group, settings in zip(optimizer.param_groups, current, strict=True):
            group.update(settings)
