"""The README stays true: every code block runs (or says why not), its configuration table is the
settings object's, its SQL is the tested SQL.

Each fenced block carries a tag (tests/readme_blocks.py explains them). Client examples run as real
programs (python, bash with curl, node) against the proxy `rlproxy serve` runs (`build_app` under
its uvicorn config) on the tiny model, in each setup the tag names, with only the environment the
README tells users to set: `OPENAI_BASE_URL` (plain or path-form) and, when the proxy has an agents'
key, `OPENAI_API_KEY` (and their Anthropic twins `ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY` for
docs/anthropic.md). The proxy maps the README's model name (`smollm2-135m`) to the tiny model
with `RLPROXY_MODEL_MAP`, as the README says an app with another model name is served. A block
that posts a reward must also fail (exit non-zero) when the proxy refuses the reward. SQL and
data blocks run in a folder whose `rlproxy.db` a short real run made (traffic through the proxy,
rewards, one training step, one failed request).
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer.rich_utils
from proxy.proxy_helpers import ProxyServer
from readme_blocks import Block, blocks, cli_lines
from support import require
from typer.testing import CliRunner

from rlproxy.cli.main import app
from rlproxy.proxy.rules import rules_markdown
from rlproxy.settings import Settings, settings_markdown
from tests.storage.test_readme_queries import QUERIES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("**/*.md"))  # the docs site's pages: the same rule for their blocks
BLOCKS = blocks(README) + [b for page in DOCS for b in blocks(page.read_text(), str(page.relative_to(ROOT)))]
BIN = Path(sys.executable).parent
KEY = "sk-readme-agents-key"
PROXY_SETUPS = {"open", "key", "path", "path-key"}
# SQL blocks whose answer is empty on the short run, and why (every other one must return rows)
EMPTY_ON_SHORT_RUN = {"Which tools the agent called": "the tiny random model calls no tools"}


def _where(b: Block) -> str:
    """A block's place in a test id: `line12` in the README, `docs-x.md-line12` in a docs page."""
    return f"line{b.line}" if b.file == "README.md" else f"{b.file.replace('/', '-')}-line{b.line}"


def _cases(kinds: set[str], setups: set[str]) -> list[Any]:
    return [
        pytest.param(b, s, id=f"{b.kind}-{_where(b)}-{s}")
        for b in BLOCKS
        if b.kind in kinds and not b.problems
        for s in b.setups
        if s in setups
    ]


# --- the tags ---------------------------------------------------------------------------------


def test_every_block_is_tagged() -> None:
    bad = [f"{b.name}: {p}" for b in BLOCKS for p in b.problems]
    assert not bad, "README blocks without a valid test tag:\n" + "\n".join(bad)
    assert {"python", "bash", "node", "sql"} <= {b.kind for b in BLOCKS}


def test_the_tag_parser_refuses_what_it_should() -> None:
    text = "\n".join(
        [
            "```bash\necho untagged\n```",
            "<!-- test: skip: -->\n```\nx\n```",
            "<!-- test: python -->\n```python\npass\n```",
            "<!-- test: python setups=open,cloud -->\n```python\npass\n```",
            "<!-- test: rust -->\n```rust\n```",
            "<!-- test: bash setups=open -->\n\n```bash\ntrue\n```",
        ]
    )
    found = blocks(text)
    assert [bool(b.problems) for b in found] == [True, True, True, True, True, False]
    assert found[-1].setups == ("open",) and found[-1].code == "true\n"


# --- client examples against a real proxy -------------------------------------------------------


def _proxy(loop_thread: Any, engine: Any, tmp: Path, key: str | None, **unchecked: Any) -> ProxyServer:
    """The app `rlproxy serve` runs, attached to the session's engine (tiny), on a fresh database."""
    from rlproxy.compose import build_app
    from rlproxy.inference.vllm import VLLMBackend

    db = tmp / "rlproxy.db"
    settings = Settings(
        db_url=f"sqlite+aiosqlite:///{db}",
        train=False,
        model=engine.served_model,
        model_map=f"smollm2-135m={engine.served_model}",
        api_key=key,
        journal_dir="off",
    ).model_copy(update=unchecked)  # unchecked: a bound below what Settings allows, to force a refusal
    backend = VLLMBackend(engine.served_model, upstream=engine.base_url)
    return ProxyServer(loop_thread, build_app(settings, backend), db).start()


def _env(**extra: str) -> dict[str, str]:
    """The test's environment minus anything OPENAI_/RLPROXY_, the venv first on PATH, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "RLPROXY_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def _setup_env(setup: str, proxy: ProxyServer) -> dict[str, str]:
    """OpenAI's variables, and Anthropic's for docs/anthropic.md (its SDK's base URL has no `/v1`)."""
    base = f"{proxy.url}/runs/ep-1/v1" if setup.startswith("path") else f"{proxy.url}/v1"
    key = {"OPENAI_API_KEY": KEY, "ANTHROPIC_API_KEY": KEY} if setup.endswith("key") else {}
    return _env(OPENAI_BASE_URL=base, ANTHROPIC_BASE_URL=base.removesuffix("/v1"), **key)


def _run(block: Block, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    if block.kind == "python":
        path, cmd = cwd / "block.py", [sys.executable, "block.py"]
    elif block.kind == "node":
        require(shutil.which("node"), "Node blocks need node 18+: apt-get install nodejs")
        path, cmd = cwd / "block.mjs", ["node", "block.mjs"]
    else:
        for program in ("curl", "jq", "sqlite3"):
            if re.search(rf"(^|[\s|;(]){program}\s", block.code):
                require(shutil.which(program), f"this block runs {program}: apt-get install {program}")
        path, cmd = cwd / "block.sh", ["bash", "-e", "-o", "pipefail", "block.sh"]
    path.write_text(block.code)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _shown(out: subprocess.CompletedProcess) -> str:
    return f"exit {out.returncode}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"


@pytest.mark.parametrize(("block", "setup"), _cases({"python", "bash", "node"}, PROXY_SETUPS))
def test_client_block_runs(block: Block, setup: str, loop_thread, embedded_backend, tmp_path: Path) -> None:
    proxy = _proxy(loop_thread, embedded_backend, tmp_path, KEY if setup.endswith("key") else None)
    try:
        out = _run(block, _setup_env(setup, proxy), tmp_path)
        assert out.returncode == 0, f"{block.name} failed in setup {setup!r}: {_shown(out)}"
        ok = proxy.query("SELECT run_id, policy FROM completions WHERE status = 'ok'")
        assert ok and all(policy == embedded_backend.served_model for _, policy in ok), ok
        if setup.startswith("path"):
            assert {run for run, _ in ok} == {"ep-1"}
        if "reward" in block.code:
            rewarded = proxy.query("SELECT id FROM runs WHERE reward IS NOT NULL")
            assert rewarded and {r for (r,) in rewarded} <= {run for run, _ in ok}
    finally:
        proxy.stop()


@pytest.mark.parametrize(("block", "setup"), _cases({"python", "bash"}, {"hosted"}))
def test_hosted_block_runs(block: Block, setup: str, loop_thread, embedded_backend, tmp_path: Path) -> None:
    """docs/hosted.md: a `teacher` policy on a strict stand-in for a hosted provider (demo/provider.py)."""
    from rlproxy.demo.directory import expert
    from rlproxy.demo.provider import Provider, ProviderServer

    provider = Provider(expert, api_key="sk-provider")
    teacher = ProviderServer(provider).start()
    served = embedded_backend.served_model
    proxy = _proxy(
        loop_thread,
        embedded_backend,
        tmp_path,
        None,
        hosted_upstreams=f"teacher={teacher.url}",
        upstream_api_key="sk-provider",
        model_map=f"smollm2-135m={served},gpt-4o-mini=teacher",
    )
    try:
        out = _run(block, _setup_env("open", proxy), tmp_path)
        assert out.returncode == 0, f"{block.name} failed in setup {setup!r}: {_shown(out)}"
        rows = proxy.query("SELECT policy, source, token_ids FROM completions WHERE status = 'ok'")
        assert rows and all(r == ("teacher", "hosted", None) for r in rows), rows
        assert provider.requests and not any("return_token_ids" in b for b in provider.requests)
    finally:
        proxy.stop()
        teacher.stop()


REWARD_BLOCKS = [
    pytest.param(b, b.setups[0], id=f"{b.kind}-{_where(b)}-{b.setups[0]}")
    for b in BLOCKS
    if b.kind in {"python", "bash", "node"}
    and not b.problems
    and "reward" in b.code
    and b.setups[0] in PROXY_SETUPS  # the hosted setup's blocks: test_hosted_block_runs
]


@pytest.mark.parametrize(("block", "setup"), REWARD_BLOCKS)
def test_client_block_checks_the_reward_status(
    block: Block, setup: str, loop_thread, embedded_backend, tmp_path: Path
) -> None:
    """With every reward refused (413: a 1-byte reward body bound), the block must exit non-zero."""
    key = KEY if setup.endswith("key") else None
    proxy = _proxy(loop_thread, embedded_backend, tmp_path, key, max_reward_body_bytes=1)
    try:
        out = _run(block, _setup_env(setup, proxy), tmp_path)
        assert proxy.query("SELECT count(*) FROM completions WHERE status = 'ok'")[0][0] >= 1, _shown(out)
        assert proxy.query("SELECT count(*) FROM runs WHERE reward IS NOT NULL") == [(0,)]
        assert out.returncode != 0, f"{block.name} ignores a refused reward (413): {_shown(out)}"
        assert "413" in out.stdout + out.stderr or "too large" in out.stdout + out.stderr, _shown(out)
    finally:
        proxy.stop()


# --- SQL and data blocks on a short real run ----------------------------------------------------


@pytest.fixture(scope="module")
def short_run(loop_thread, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`rlproxy.db` after a short real run: 4 rewarded runs of one task -> training step 1 ->
    2 more runs served by step 1, one rewarded; one request the engine refuses (a failed completion)."""
    import httpx
    import openai

    from rlproxy.compose import build_app
    from rlproxy.inference.embedded import EmbeddedBackend

    folder = tmp_path_factory.mktemp("short-run")
    db = folder / "rlproxy.db"
    settings = Settings(
        db_url=f"sqlite+aiosqlite:///{db}",
        model=str(tiny_model_dir),
        group_size=4,
        poll_interval=0.1,
        learning_rate=1e-3,
        checkpoint_dir=str(folder / "checkpoints"),
        train_threads=1,
        engine_threads=1,
        journal_dir="off",
    )
    backend = EmbeddedBackend(str(tiny_model_dir), threads=1, max_batch=4)
    proxy = ProxyServer(loop_thread, build_app(settings, backend), db).start()
    try:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0)
        task = [{"role": "user", "content": "Pick a number between 1 and 10."}]

        def episode(run_id: str, reward: float | None) -> None:
            client.chat.completions.create(
                model=backend.served_model,
                messages=task,
                max_tokens=6,
                extra_headers={"X-Run-Id": run_id},
            )
            if reward is not None:
                r = httpx.post(f"{proxy.url}/v1/runs/{run_id}/reward", json={"reward": reward})
                r.raise_for_status()

        for i, reward in enumerate([1.0, 0.0, 0.5, 0.0]):
            episode(f"ep-{i}", reward)
        deadline = time.monotonic() + 300
        while not proxy.query("SELECT step FROM training_steps"):
            assert time.monotonic() < deadline, "the short run's training step did not happen"
            time.sleep(0.2)
        while proxy.state.policies.step(backend.served_model) < 1:
            assert time.monotonic() < deadline, "step 1 was not published"
            time.sleep(0.1)
        episode("ep-4", 1.0)
        episode("ep-5", None)
        with pytest.raises(openai.BadRequestError):  # longer than the model's context: stored as failed
            client.chat.completions.create(
                model=backend.served_model,
                messages=task,
                max_tokens=100_000,
                extra_headers={"X-Run-Id": "ep-6"},
            )
        proxy.flush()
    finally:
        proxy.stop()
    con = sqlite3.connect(db)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    yield db


@pytest.fixture
def data_folder(short_run: Path, tmp_path: Path) -> Path:
    """A working folder holding a copy of the short run's `rlproxy.db` (blocks may write files)."""
    shutil.copy(short_run, tmp_path / "rlproxy.db")
    return tmp_path


def test_short_run_is_what_the_blocks_expect(short_run: Path) -> None:
    con = sqlite3.connect(f"file:{short_run}?mode=ro", uri=True)
    try:
        assert con.execute("SELECT count(*) FROM training_steps").fetchone() == (1,)
        assert con.execute("SELECT DISTINCT policy_step FROM completions ORDER BY 1").fetchall() == [
            (0,),
            (1,),
        ]
        assert con.execute("SELECT count(*) FROM completions WHERE status_code >= 400").fetchone() == (1,)
    finally:
        con.close()


SQL_BLOCKS = [pytest.param(b, id=f"sql-{_where(b)}") for b in BLOCKS if b.kind == "sql" and not b.problems]


@pytest.mark.parametrize("block", SQL_BLOCKS)
def test_sql_block_runs_with_sqlite3(block: Block, data_folder: Path) -> None:
    """As the README says: `sqlite3 rlproxy.db` with the block as input."""
    require(shutil.which("sqlite3"), "the sqlite3 program: apt-get install sqlite3")
    out = subprocess.run(
        ["sqlite3", "-bail", "-batch", "rlproxy.db"],
        input=block.code,
        cwd=data_folder,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and not out.stderr, f"{block.name}: {_shown(out)}"
    empty_ok = [t for t in EMPTY_ON_SHORT_RUN if t.lower() in block.code.lower()]
    assert out.stdout.strip() or empty_ok, f"{block.name} returned no rows on the short run"


@pytest.mark.parametrize(("block", "setup"), _cases({"shell"}, {"db"}))
def test_data_block_runs(block: Block, setup: str, data_folder: Path) -> None:
    out = _run(block, _env(), data_folder)
    print(out.stdout)  # shown on failure, and with -s
    assert out.returncode == 0, f"{block.name}: {_shown(out)}"
    assert out.stdout.strip() or any(data_folder.iterdir()), f"{block.name} printed and wrote nothing"


def test_every_block_kind_is_run_somewhere() -> None:
    """A tag whose kind/setup no test runs would excuse a block silently."""
    for b in BLOCKS:
        if b.kind in {"python", "bash", "node"}:
            runs_in = PROXY_SETUPS | {"hosted"}
            assert set(b.setups) <= runs_in, f"{b.name}: client blocks run in {sorted(runs_in)}"
        if b.kind == "shell":
            assert b.setups == ("db",), f"{b.name}: shell blocks run in setups=db"


# --- command lines: every option a block names exists --------------------------------------------


@cache
def _help(words: tuple[str, ...]) -> tuple[int, str]:
    """`rlproxy WORDS --help`, in process (the entry point itself is tests/cli/test_cli_help.py's)."""
    width, typer.rich_utils.MAX_WIDTH = typer.rich_utils.MAX_WIDTH, 250
    try:
        out = CliRunner().invoke(app, [*words, "--help-all"])  # serve, train: every setting's option
        if out.exit_code != 0:
            out = CliRunner().invoke(app, [*words, "--help"])
    finally:
        typer.rich_utils.MAX_WIDTH = width
    return out.exit_code, out.output


def _command(words: list[str]) -> tuple[str, ...]:
    """The longest prefix of `words` that is an rlproxy command (`db upgrade`, `models prepare`)."""
    cmd = (words[0],)
    for word in words[1:]:
        rc, text = _help(cmd)
        if rc != 0 or not re.search(rf"^\W*{re.escape(word)}\s", text, re.M):
            break
        cmd = (*cmd, word)
    return cmd


def _option_problems(code: str, where: str) -> list[str]:
    problems = []
    for words, options in cli_lines(code):
        cmd = _command(words)
        rc, text = _help(cmd)
        if rc != 0:
            problems.append(f"{where}: `rlproxy {' '.join(cmd)}` is not a command")
            continue
        known = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
        missing = sorted(set(options) - known)
        if missing:
            problems.append(f"{where}: `rlproxy {' '.join(cmd)}` has no {missing}")
    return problems


def test_command_lines_name_real_options() -> None:
    problems = [p for b in BLOCKS for p in _option_problems(b.code, b.name)]
    assert not problems, "\n".join(problems)
    synopsis = (
        "rlproxy serve   [--model NAME]\n                [--no-such-flag]\nrlproxy db upgrade --db URL\n"
    )
    assert _option_problems(synopsis, "x") == ["x: `rlproxy serve` has no ['--no-such-flag']"]
    assert _option_problems("rlproxy nosuch --db X", "x") == ["x: `rlproxy nosuch` is not a command"]


# --- the configuration table and the tested queries -----------------------------------------------


CONFIGURATION = ROOT / "docs" / "configuration.md"  # the settings table's page
DATA = ROOT / "docs" / "data.md"  # the "Query your trajectories" section's page


def _generated(page: Path, marker: str, want: str, command: str) -> None:
    """`page` holds `want` between its `<!-- marker:start -->` and `<!-- marker:end -->` lines."""
    table = re.search(rf"<!-- {marker}:start -->\n(.*?)\n<!-- {marker}:end -->", page.read_text(), re.S)
    assert table, f"docs/{page.name} lost its {marker} markers"
    assert table.group(1).strip() == want.strip(), (
        f"docs/{page.name}'s {marker} table is stale: paste the output of `python -c '{command}'`"
    )


def test_configuration_table_is_generated_from_settings() -> None:
    command = "from rlproxy.settings import settings_markdown; print(settings_markdown())"
    _generated(CONFIGURATION, "settings", settings_markdown(), command)


SECURITY = ROOT / "docs" / "security.md"  # the route rules' table's page


def test_route_rules_table_is_generated_from_the_rules() -> None:
    command = "from rlproxy.proxy.rules import rules_markdown; print(rules_markdown())"
    _generated(SECURITY, "rules", rules_markdown(), command)


def test_readme_queries_are_the_tested_queries() -> None:
    """tests/storage/test_readme_queries.py checks their exact answers on a sample database."""
    text = DATA.read_text()
    for title, sql in QUERIES.items():
        assert sql.strip() in text, (
            f"docs/data.md query {title!r} differs from tests/storage/test_readme_queries.py"
        )


def test_front_door_commands() -> None:
    assert "make demo" in README and "make test" in README
    assert len(README.splitlines()) <= 300, "the README is the five-minute start: <= 300 lines"
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    assert {"install", "demo", "test", "docs", "bench-compare"} <= targets


# --- defaults quoted in prose are the settings' ----------------------------------------------------

# "`group_size` (default 4)" or "`group_timeout` (default `600.0`)": a setting's name in backquotes,
# then its default in parentheses. Each such quote must be the setting's default.
_QUOTED_DEFAULT = re.compile(r"`([a-z_]+)` \(default `?([^`),;]+)`?[),;]")


def _defaults() -> dict[str, str]:
    from rlproxy.cli.options import default_text

    return {name: str(default_text(name)) for name in Settings.model_fields}


def _quoted_default_problems(text: str, where: str) -> list[str]:
    defaults, problems = _defaults(), []
    for name, value in _QUOTED_DEFAULT.findall(text):
        if name in defaults and value.strip() not in {defaults[name], defaults[name].lower()}:
            problems.append(
                f"{where}: `{name}` (default {value.strip()}) but the setting's is {defaults[name]}"
            )
    return problems


def test_quoted_defaults_are_the_settings() -> None:
    pages = [("README.md", README)] + [(str(p.relative_to(ROOT)), p.read_text()) for p in DOCS]
    problems = [p for where, text in pages for p in _quoted_default_problems(text, where)]
    assert not problems, "\n".join(problems)
    assert _quoted_default_problems("`group_size` (default 8)", "x") == [
        "x: `group_size` (default 8) but the setting's is 4"
    ]
    assert not _quoted_default_problems("`group_size` (default 4) and `beta` (default `0.0`)", "x")


# --- the docs site ----------------------------------------------------------------------------------


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, a missing nav page or a bad anchor fails."""
    mkdocs = BIN / "mkdocs"
    require(mkdocs.exists(), "the docs site needs mkdocs (the dev extra): .venv/bin/pip install -e '.[dev]'")
    out = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, _shown(out)
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
