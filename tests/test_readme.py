"""The README stays true: its configuration table is the settings object's, its SQL is the tested SQL."""

from __future__ import annotations

import re
from pathlib import Path

from rlproxy.settings import settings_markdown
from tests.storage.test_readme_queries import QUERIES

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_configuration_table_is_generated_from_settings() -> None:
    table = re.search(r"<!-- settings:start -->\n(.*?)\n<!-- settings:end -->", README, re.S)
    assert table, "README.md lost its settings markers"
    assert table.group(1).strip() == settings_markdown().strip(), (
        "README configuration table is stale: paste the output of "
        "`python -c 'from rlproxy.settings import settings_markdown; print(settings_markdown())'`"
    )


def test_readme_queries_are_the_tested_queries() -> None:
    for title, sql in QUERIES.items():
        assert sql.strip() in README, (
            f"README query {title!r} differs from tests/storage/test_readme_queries.py"
        )


def test_front_door_commands() -> None:
    assert "make demo" in README and "make test" in README
