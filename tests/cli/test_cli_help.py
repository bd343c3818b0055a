"""Every `--help` shows each option's environment variable and default, and they are the settings'
(the configuration table in docs/configuration.md, which a README test keeps equal to `Settings`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import typer
import typer.rich_utils
from typer.testing import CliRunner

from rlproxy.cli.main import app
from rlproxy.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
RLPROXY = str(Path(sys.executable).parent / "rlproxy")
runner = CliRunner()


def readme_table() -> dict[str, str]:
    """environment variable -> default, as the settings table (docs/configuration.md) says."""
    table = (
        ROOT.joinpath("docs", "configuration.md")
        .read_text()
        .split("<!-- settings:start -->")[1]
        .split("<!-- settings:end -->")[0]
    )
    rows = re.findall(r"^\| `(\w+)` \| `(RLPROXY_\w+)` \| `([^`]*)` \|", table, re.M)
    return {env: default for _name, env, default in rows}


def commands(group=None, path=()):  # noqa: ANN001, ANN201
    """(command words, click command) of every command and group."""
    group = group or typer.main.get_command(app)
    yield path, group
    for name, cmd in getattr(group, "commands", {}).items():
        yield from commands(cmd, (*path, name)) if hasattr(cmd, "commands") else [((*path, name), cmd)]


def wide_help(words: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 1000)  # one line per option: no wrapping
    cmd = dict(commands())[words]
    every = any("--help-all" in getattr(p, "opts", ()) for p in cmd.params)  # serve, train: all of them
    out = runner.invoke(app, [*words, "--help-all" if every else "--help"])
    assert out.exit_code == 0, out.output
    return out.output


ALL = [words for words, _ in commands()]


@pytest.mark.parametrize("words", ALL, ids=lambda w: " ".join(w) or "rlproxy")
def test_every_option_shows_its_setting(words, monkeypatch):
    table = readme_table()
    assert "RLPROXY_DB_URL" in table and table["RLPROXY_PORT"] == "8000"  # the parse found the table
    cmd = dict(commands())[words]
    text = wide_help(words, monkeypatch)
    lines = text.splitlines()
    assert "RLPROXY_<OPTION>" not in text  # the old, wrong rule
    for param in cmd.params:
        if not getattr(param, "opts", None) or param.name == "help" or param.param_type_name != "option":
            continue
        line = next((ln for ln in lines if re.search(rf"[│ ]{re.escape(param.opts[0])}\b", ln)), None)
        assert line is not None, f"{param.opts[0]} is not in `{' '.join(words)} --help`"
        if not param.envvar:
            assert "[env var:" not in line, line
            continue
        assert param.envvar in table, f"{param.opts[0]}: {param.envvar} is not a setting in the README table"
        name = param.envvar.removeprefix("RLPROXY_").lower()
        assert name in Settings.model_fields
        assert f"[env var: {param.envvar}]" in line, line
        default = table[param.envvar]
        if default in ("None", ""):  # no default to show
            assert "[default:" not in line, line
        elif param.is_flag and param.secondary_opts:  # --train/--no-train: the default's flag
            flag = param.opts[0] if default == "True" else param.secondary_opts[0]
            assert f"[default: {flag.removeprefix('--')}]" in line, line
        else:  # a default the option does not carry itself (--db: data_dir's) is shown in parentheses
            assert f"[default: {default}]" in line or f"[default: ({default})]" in line, line


def test_known_option_names():
    """The mappings the old footer got wrong: each option names its own setting."""
    by_command = {words: cmd for words, cmd in commands()}

    def env(words: tuple[str, ...], opt: str) -> str | None:
        return next(p.envvar for p in by_command[words].params if opt in getattr(p, "opts", ()))

    assert env(("serve",), "--db") == "RLPROXY_DB_URL"
    assert env(("sql",), "--timeout") == "RLPROXY_SQL_TIMEOUT"
    assert env(("engine",), "--threads") == "RLPROXY_ENGINE_THREADS"
    assert env(("serve",), "--log-level") is None  # not a setting: no variable promised
    assert env(("engine",), "--port") is None  # the engine's own port, not the proxy's RLPROXY_PORT


def test_types_and_choices_are_shown(monkeypatch):
    text = wide_help(("serve",), monkeypatch)
    assert "<embedded|vllm>" in text and "<debug|info|warning|error>" in text
    assert "[0<=x<=65535]" in text  # --port is an int in range, not <str>
    assert "<open|completed|trained|skipped|failed|expired" in wide_help(("runs",), monkeypatch)
    assert "<jsonl|parquet|hf|otlp|otlp-proto>" in wide_help(("export",), monkeypatch)


def test_env_var_sets_the_option(tmp_path):
    """`RLPROXY_DB_URL` is what `--db` reads when not given (shown by the error naming its path)."""
    db = tmp_path / "from-env.db"
    done = subprocess.run(
        [RLPROXY, "runs"],
        env={"RLPROXY_DB_URL": str(db), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and str(db) in done.stderr


def test_version_and_real_help():
    done = subprocess.run([RLPROXY, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"rlproxy {version('rlproxy')}"
    done = subprocess.run(
        [RLPROXY, "sql", "--help"], capture_output=True, text=True, timeout=120, env={"TERMINAL_WIDTH": "300"}
    )
    assert done.returncode == 0
    assert "[env var: RLPROXY_DB_URL]" in done.stdout and "[env var: RLPROXY_SQL_TIMEOUT]" in done.stdout


def test_serve_help_fits_a_terminal():
    """`serve --help` at 80 columns: the options a first start needs, nothing cut (issue 56: 1,202
    lines, 345 "…"); every setting's option behind --help-all; `rlproxy settings` lists them all."""
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    short = subprocess.run([RLPROXY, "serve", "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert short.returncode == 0 and len(short.stdout.splitlines()) <= 60, short.stdout
    assert "…" not in short.stdout and "--model" in short.stdout and "--help-all" in short.stdout
    assert "--learning-rate" not in short.stdout
    full = subprocess.run(
        [RLPROXY, "serve", "--help-all"], capture_output=True, text=True, timeout=120, env=env
    )
    assert full.returncode == 0 and "--learning-rate" in full.stdout and "Settings: trainer" in full.stdout
    listed = subprocess.run([RLPROXY, "settings"], capture_output=True, text=True, timeout=120, env=env)
    assert listed.returncode == 0 and "…" not in listed.stdout
    assert all(f"RLPROXY_{name.upper()}" in listed.stdout for name in Settings.model_fields)
    assert max(len(line) for line in listed.stdout.splitlines()) <= 80
    top = subprocess.run([RLPROXY, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert "README's table" not in top.stdout and "rlproxy settings" in top.stdout
