"""`rlproxy serve`'s log for a short run with one training step reads like a log: rlproxy's own lines,
no Alembic INFO, no progress-bar carriage returns, no FutureWarnings, the step line with real numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

BIN = Path(sys.executable).parent


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    pytest.fail(f"no {pattern!r} in serve's log:\n{log.read_text(errors='replace')[-4000:]}")


def test_serve_log_is_clean(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    env = {
        **os.environ,
        "RLPROXY_ENGINE_THREADS": "1",
        "RLPROXY_TRAIN_THREADS": "1",
        "RLPROXY_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
    }
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE", "PYTHONWARNINGS"):
        env.pop(name, None)  # serve must quiet them itself
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "rlproxy"), "serve", "--model", str(tiny_model_dir), "--port", "0"]
            + ["--db", str(tmp_path / "serve.db"), "--group-size", "2", "--no-access-log"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    try:
        base = _wait_for(log, r"OPENAI_BASE_URL=(\S+)", proc, 180).group(1)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for i, reward in enumerate([1.0, 0.0]):  # one group of two different rewards: one step
            headers = {"X-Run-Id": f"log-{i}", "X-Group-Id": "log"}
            r = httpx.post(f"{base}/chat/completions", json=chat, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{base}/runs/log-{i}/reward", json={"reward": reward}, timeout=30)
            assert r.status_code == 200, r.text
        step = _wait_for(log, r"step 1 tiny: .*", proc, 120).group(0)
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text(errors="replace")

    assert "\r" not in text  # no progress bars
    assert "FutureWarning" not in text
    assert not re.search(r"INFO\s+alembic", text), text
    assert "Loading weights" not in text
    # the step line: loss and KL with the precision they have (%.3g), never `0.0000`
    assert re.search(r"loss -?[0-9.]+(e[-+][0-9]+)?, kl -?[0-9.]+(e[-+][0-9]+)?,", step), step
    assert "0.0000" not in step
    # rlproxy's own INFO lines are still there
    assert "rlproxy.storage.db: migrating" in text and "policy tiny now serves step 1" in text
