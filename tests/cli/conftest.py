"""CLI fixtures: the proxy tests' proxy factory (tests/proxy/conftest.py), shared so that CLI tests can
fill a store through a real proxy (in front of tests/conftest.py's stub upstream)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PROXY_TESTS = Path(__file__).resolve().parents[1] / "proxy"
sys.path.insert(0, str(PROXY_TESTS))  # proxy_helpers, imported by the proxy conftest and the tests

_spec = importlib.util.spec_from_file_location("proxy_conftest", PROXY_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_proxy_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_proxy_conftest)

make_proxy = _proxy_conftest.make_proxy
