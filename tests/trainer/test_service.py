"""TrainerService on a real SQLite file and the tiny model; the backend records what it was asked to load.

(The proxy's end-to-end tests use the real engines; here the subject is the service's own contract:
select → train → checkpoint → load_adapter → commit → on_publish, recovery, unloading, a free event loop.)
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from support import ServerlessBackend

from rlproxy.errors import AdapterError, BackendUnavailable
from rlproxy.trainer import checkpoint as ckpt
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.service import TrainerService


class RecordingBackend(ServerlessBackend):
    """Backend protocol: records adapter loads/unloads; `fail_loads` makes load_adapter raise."""

    def __init__(self, model_path: Path) -> None:
        super().__init__(model_path)
        self.loaded: dict[str, str] = {}
        self.events: list[tuple[str, str]] = []
        self.fail_loads = 0

    async def load_adapter(self, name: str, path: str) -> None:
        if self.fail_loads:
            self.fail_loads -= 1
            raise BackendUnavailable("backend down")
        assert (Path(path) / "adapter_config.json").is_file()
        self.loaded[name] = path
        self.events.append(("load", name))

    async def unload_adapter(self, name: str) -> None:
        if name not in self.loaded:
            raise AdapterError(f"{name} not loaded", status=404)
        del self.loaded[name]
        self.events.append(("unload", name))


def completions(rng: random.Random) -> list[dict[str, Any]]:
    prompt = [rng.randrange(3, 1200) for _ in range(rng.randint(4, 10))]
    tokens = [rng.randrange(3, 1200) for _ in range(rng.randint(2, 8))]
    return [{"prompt_token_ids": prompt, "token_ids": [tokens], "logprobs": None}]


async def add_group(engine: AsyncEngine, add_run: Any, gid: str, rewards: list[float], seed: int = 0) -> None:
    rng = random.Random(seed)
    for i, r in enumerate(rewards):
        await add_run(engine, f"{gid}-{i}", group_id=gid, reward=r, completions=completions(rng))


async def statuses(engine: AsyncEngine) -> dict[str, tuple[str, int | None]]:
    async with engine.connect() as conn:
        return {
            r[0]: (r[1], r[2]) for r in await conn.execute(text("SELECT id, status, trained_step FROM runs"))
        }


async def test_step_once_trains_publishes_commits(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, config: TrainerConfig
) -> None:
    await add_group(engine, add_run, "A", [1.0, 0.0, 0.5, 0.25])
    await add_group(engine, add_run, "Z", [1.0, 1.0, 1.0, 1.0], seed=1)  # zero variance: skipped
    backend = RecordingBackend(tiny_model_dir)
    published, states = [], []

    async def on_publish(policy: str, step: int) -> None:
        # by the time the alias flips, the adapter is loaded and the step committed
        assert f"{policy}@{step}" in backend.loaded
        published.append((policy, step, (await statuses(engine))["A-0"]))

    svc = TrainerService(config, db_url, backend, on_publish=on_publish, on_train_state=states.append)
    try:
        m = await svc.step_once()
        assert m is not None and m["policy"] == "tiny" and m["step"] == 1
        assert await svc.step_once() is None  # nothing left
    finally:
        await svc.stop()
    assert published == [("tiny", 1, ("trained", 1))]
    assert states == [True, False]
    assert backend.events == [("load", "tiny@1")]
    st = await statuses(engine)
    assert {k: v for k, v in st.items() if k.startswith("A")} == {f"A-{i}": ("trained", 1) for i in range(4)}
    assert {v for k, v in st.items() if k.startswith("Z")} == {("skipped", None)}
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT * FROM training_steps"))).mappings().one()
    assert (row["step"], row["policy"], row["num_groups"], row["num_runs"]) == (1, "tiny", 1, 4)
    assert row["mean_reward"] == pytest.approx(0.4375)
    assert Path(row["adapter_path"]) == Path(config.checkpoint_dir) / "tiny" / "step-0001"
    metrics = row["metrics"] if isinstance(row["metrics"], dict) else __import__("json").loads(row["metrics"])
    for key in (
        "loss/total",
        "kl/approx",
        "clip/frac",
        "reward/mean",
        "perf/seconds",
        "perf/policy_lag_mean",
    ):
        assert key in metrics


async def test_waits_for_groups_per_step(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, config: TrainerConfig
) -> None:
    config = config.model_copy(update={"groups_per_step": 2})
    svc = TrainerService(config, db_url, RecordingBackend(tiny_model_dir))
    try:
        await add_group(engine, add_run, "A", [1.0, 0.0, 0.5, 0.25])
        assert await svc.step_once() is None  # one of two groups: wait
        await add_group(engine, add_run, "B", [0.0, 0.0, 1.0, 0.0], seed=2)
        m = await svc.step_once()
        assert m is not None and m["reward/groups"] == 2.0
    finally:
        await svc.stop()


async def test_crash_between_save_and_commit_is_recovered_once(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, config: TrainerConfig
) -> None:
    await add_group(engine, add_run, "A", [1.0, 0.0, 0.5, 0.25])
    backend = RecordingBackend(tiny_model_dir)
    backend.fail_loads = 1  # saved, then the publish fails: the step is on disk, not in the database
    svc = TrainerService(config, db_url, backend)
    with pytest.raises(BackendUnavailable):
        await svc.step_once()
    await svc.stop()
    assert [c.step for c in ckpt.list_checkpoints(config.checkpoint_dir, "tiny")] == [1]
    assert {s for s, _ in (await statuses(engine)).values()} == {"completed"}

    published = []

    async def on_publish(policy: str, step: int) -> None:
        published.append((policy, step))

    svc2 = TrainerService(config, db_url, backend, on_publish=on_publish)  # "restarted"
    try:
        await svc2.start()
        assert published == [("tiny", 1)]
        assert await svc2.recover() == []  # exactly once
        assert await svc2.step_once() is None
    finally:
        await svc2.stop()
    assert set((await statuses(engine)).values()) == {("trained", 1)}
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM training_steps"))).scalar() == 1


async def test_old_adapters_unloaded_after_grace(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, config: TrainerConfig
) -> None:
    config = config.model_copy(update={"keep_checkpoints": 1, "unload_grace": 0.2})
    backend = RecordingBackend(tiny_model_dir)
    svc = TrainerService(config, db_url, backend)
    try:
        for step, gid in enumerate(["A", "B"], start=1):
            await add_group(engine, add_run, gid, [1.0, 0.0, 0.5, 0.25], seed=step)
            assert (await svc.step_once())["step"] == step
        assert set(backend.loaded) == {"tiny@1", "tiny@2"}  # in-flight requests may still use step 1
        await asyncio.sleep(0.5)
        assert set(backend.loaded) == {"tiny@2"}
        assert [c.step for c in ckpt.list_checkpoints(config.checkpoint_dir, "tiny")] == [2]
    finally:
        await svc.stop()


async def test_event_loop_stays_free_during_a_step(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, config: TrainerConfig
) -> None:
    await add_group(engine, add_run, "A", [1.0, 0.0, 0.5, 0.25])
    svc = TrainerService(config, db_url, RecordingBackend(tiny_model_dir))
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = asyncio.create_task(ticker())
    try:
        await svc.start()  # the background loop finds the group by itself
        for _ in range(600):
            if svc.steps_done:
                break
            await asyncio.sleep(0.05)
        assert svc.steps_done == 1
    finally:
        done.set()
        await t
        await svc.stop()
    # model loading and the step ran on the trainer thread: the loop kept ticking
    assert max(gaps) < 0.5, max(gaps)


async def test_runs_without_usable_completions_fail(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, config: TrainerConfig
) -> None:
    await add_group(engine, add_run, "A", [1.0, 0.0, 0.5], seed=3)
    error = {"status": "error", "status_code": 502, "error": "upstream down", "response": None}
    await add_run(engine, "A-err", group_id="A", reward=0.0, completions=[error])
    svc = TrainerService(config, db_url, RecordingBackend(tiny_model_dir))
    try:
        assert await svc.step_once() is None  # 3 usable runs left: below group_size, the group waits
    finally:
        await svc.stop()
    st = await statuses(engine)
    assert st["A-err"] == ("failed", None)
    assert {st[f"A-{i}"] for i in range(3)} == {("completed", None)}


async def test_non_finite_step_is_skipped_and_runs_stay_trainable(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, config: TrainerConfig, monkeypatch
) -> None:
    """Issue 16 bug 3: a step with a non-finite gradient was checkpointed, published and committed."""
    from rlproxy.trainer import service as service_mod

    real = service_mod.train_step

    def nan_step(model, *args, **kwargs):  # a forced non-finite gradient
        param = next(p for p in model.parameters() if p.requires_grad)
        hook = param.register_hook(lambda g: g * float("nan"))
        try:
            return real(model, *args, **kwargs)
        finally:
            hook.remove()

    await add_group(engine, add_run, "A", [1.0, 0.0, 0.5, 0.25])
    backend = RecordingBackend(tiny_model_dir)
    svc = TrainerService(config, db_url, backend)
    try:
        monkeypatch.setattr(service_mod, "train_step", nan_step)
        assert await svc.step_once() is None
        assert svc.steps_skipped == 1 and svc.last_metrics["step/skipped_nonfinite"] == 1.0
        assert backend.events == [] and ckpt.list_checkpoints(config.checkpoint_dir, "tiny") == []
        assert {s for s, _ in (await statuses(engine)).values()} == {"completed"}  # still trainable
        monkeypatch.setattr(service_mod, "train_step", real)
        m = await svc.step_once()
        assert m is not None and m["step"] == 1 and m["step/skipped_nonfinite"] == 0.0
        # the same runs failing again and again are failed after NONFINITE_RETRIES, not retried forever
        await add_group(engine, add_run, "B", [1.0, 0.0, 0.5, 0.25], seed=5)
        monkeypatch.setattr(service_mod, "train_step", nan_step)
        for _ in range(service_mod.NONFINITE_RETRIES):
            assert await svc.step_once() is None
    finally:
        await svc.stop()
    st = await statuses(engine)
    assert {st[f"A-{i}"] for i in range(4)} == {("trained", 1)}
    assert {st[f"B-{i}"] for i in range(4)} == {("failed", None)}


async def test_stale_runs_are_skipped(
    engine: AsyncEngine, add_run: Any, db_url: str, tiny_model_dir: Path, config: TrainerConfig
) -> None:
    """Issue 16 risk 6: samples older than max_policy_lag adapter steps are not trained on."""
    config = config.model_copy(update={"max_policy_lag": 1})
    svc = TrainerService(config, db_url, RecordingBackend(tiny_model_dir))
    try:
        for step, gid in enumerate(["A", "B"], start=1):  # sampled by step 0, trained at lag 0 and 1
            await add_group(engine, add_run, gid, [1.0, 0.0, 0.5, 0.25], seed=step)
            assert (await svc.step_once())["step"] == step
        await add_group(engine, add_run, "C", [1.0, 0.0, 0.5, 0.25], seed=3)  # lag 2 at step 3
        assert await svc.step_once() is None
    finally:
        await svc.stop()
    st = await statuses(engine)
    assert {st[f"C-{i}"] for i in range(4)} == {("skipped", None)}
