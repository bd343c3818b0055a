"""The reward curve is optional: without matplotlib the demo says how to get it and goes on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlproxy.demo.plot import INSTALL_HINT, plot_rewards


def test_without_matplotlib_it_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    lines: list[str] = []
    rows = [{"step": 1, "mean_reward": 0.5}]
    assert plot_rewards(rows, tmp_path / "curve.png", "tiny", lines.append) is None
    assert not (tmp_path / "curve.png").exists()
    assert any(INSTALL_HINT in line for line in lines)
