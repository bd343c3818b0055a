"""The 2048 README's commands name options and variables that exist (the real CLI, Settings, play.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from rlproxy.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "examples" / "2048" / "README.md").read_text()


def _help(*cmd: str) -> set[str]:
    env = {**os.environ, "COLUMNS": "250", "TERM": "dumb", "NO_COLOR": "1"}
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", out.stdout))


def _commands(program: str) -> list[str]:
    """Every command line in the README that runs `program` (backslash continuations joined)."""
    text = README.replace("\\\n", " ")
    return [line for line in text.splitlines() if re.search(rf"(^|[\s/]){re.escape(program)}\s", line)]


def test_serve_options_exist():
    rlproxy = Path(sys.executable).with_name("rlproxy")
    known = _help(str(rlproxy), "serve")
    used = {opt for line in _commands("rlproxy serve") for opt in re.findall(r"\s(--[a-z][a-z-]*)", line)}
    assert {"--backend", "--model", "--group-size"} <= used
    assert used <= known, sorted(used - known)


def test_environment_variables_are_settings():
    used = set(re.findall(r"\b(RLPROXY_[A-Z_]+)", README))
    assert used <= {f"RLPROXY_{f.upper()}" for f in Settings.model_fields}, sorted(used)


def test_play_options_exist():
    known = _help(sys.executable, str(ROOT / "examples" / "2048" / "play.py"))
    table = set(re.findall(r"^\| `(--[a-z-]+)`", README, re.MULTILINE))
    used = {opt for line in _commands("play.py") for opt in re.findall(r"\s(--[a-z][a-z-]*)", line)}
    assert len(table) >= 10
    assert table | used <= known, sorted((table | used) - known)
