"""The built wheel holds every file the package reads at run time, not only its Python modules.

An installed rlproxy (`pip install rlproxy`, the Docker image) reads the dashboard's page, scripts
and styles (proxy/static/), the migrations' alembic.ini and mako template
from its own folder. Package data is listed by hand in pyproject.toml; a file it misses works in
a clone and is a 500 once installed (issue 56: style.css). This builds the wheel from a copy of the
tracked sources and compares its file list with every file under rlproxy/ that is not Python. The
full round trip (a fresh venv outside the clone, `serve`, every dashboard asset, one rewarded
episode) is `.ci/wheel-check`, run by CI.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked(prefix: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", prefix],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [line for line in out.stdout.splitlines() if line]


def test_wheel_holds_every_runtime_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name in ["pyproject.toml", "README.md", *_tracked("rlproxy")]:  # a copy: no build/ in the clone
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("rlproxy-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f for f in _tracked("rlproxy") if not f.endswith((".py", ".pyc"))}
    assert wanted, "no data files found under rlproxy/"
    assert wanted - shipped == set(), "add them to [tool.setuptools.package-data] in pyproject.toml"
    for static in ("style.css", "app.js", "chart.js", "index.html"):
        assert f"rlproxy/proxy/static/{static}" in shipped
    assert "rlproxy/migrations/versions/0001_initial.py" in shipped
