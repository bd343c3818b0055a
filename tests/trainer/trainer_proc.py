"""A trainer process for the crash test: `python trainer_proc.py DB_URL CKPT_DIR MODEL_DIR MODE MARKER`.

MODE normal: train every ready step, print the steps as JSON, exit.
MODE hang-train: after the optimizer step (weights changed in memory, nothing saved), touch MARKER and hang.
MODE hang-publish: after the checkpoint is saved, in load_adapter, touch MARKER and hang.
The test SIGKILLs the hanging process at the marker, then runs MODE normal.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from support import ServerlessBackend  # noqa: E402

import rlproxy.trainer.service as service  # noqa: E402
from rlproxy.trainer.config import TrainerConfig  # noqa: E402
from rlproxy.trainer.service import TrainerService  # noqa: E402


class FileBackend(ServerlessBackend):
    """Backend protocol without a server: 'loads' an adapter by checking its folder."""

    def __init__(self, model_path: str, hang: bool, marker: Path) -> None:
        super().__init__(model_path)
        self.hang, self.marker = hang, marker

    async def load_adapter(self, name: str, path: str) -> None:
        assert (Path(path) / "adapter_model.safetensors").is_file()
        if self.hang:
            self.marker.write_text(name)
            await asyncio.sleep(3600)


async def main(db_url: str, ckpt_dir: str, model_dir: str, mode: str, marker: Path) -> None:
    torch.set_num_threads(1)
    if mode == "hang-train":
        real = service.train_step

        def hanging_train_step(*args, **kwargs):
            result = real(*args, **kwargs)
            marker.write_text("trained")
            time.sleep(3600)
            return result

        service.train_step = hanging_train_step
    config = TrainerConfig(group_size=4, groups_per_step=2, learning_rate=1e-3, checkpoint_dir=ckpt_dir)
    svc = TrainerService(config, db_url, FileBackend(model_dir, mode == "hang-publish", marker))
    steps = []
    try:
        await svc.start()  # recovers a step saved but not committed
        while (m := await svc.step_once()) is not None:
            steps.append(m["step"])
    finally:
        await svc.stop()
    print(json.dumps({"steps": steps}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5])))
