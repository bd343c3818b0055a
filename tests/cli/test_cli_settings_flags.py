"""Every setting a flag where a user looks for it (issue 26, item 4): `serve --learning-rate` and
`--report-to` were "No such option" (the latter suggesting `--port`); an unknown option that is a
setting now says which variable sets it; a flag's help shows no `<bool>` type."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from rlproxy.cli import main
from rlproxy.settings import Settings

runner = CliRunner()


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """`serve`'s settings, captured instead of serving."""
    got: list[Settings] = []

    def fake_serve(settings: Settings, *_: Any, **__: Any) -> None:
        got.append(settings)

    monkeypatch.setattr(main, "_serve", fake_serve)
    return got


def test_serve_takes_every_setting_as_a_flag(served, monkeypatch):
    monkeypatch.setenv("RLPROXY_LORA_R", "16")  # a variable still counts where no flag is given
    out = runner.invoke(
        main.app,
        [
            "serve",
            "--learning-rate",
            "1e-4",
            "--report-to",
            "tensorboard",
            "--no-overlong-filter",
            "--beta",
            "0.02",
        ],
    )
    assert out.exit_code == 0, out.output
    (settings,) = served
    assert settings.learning_rate == 1e-4 and settings.report_to == "tensorboard"
    assert settings.beta == 0.02 and settings.lora_r == 16 and settings.overlong_filter is False
    assert settings.group_size == Settings.model_fields["group_size"].default  # defaults untouched


def test_train_takes_trainer_settings(monkeypatch):
    seen: list[Settings] = []

    async def fake_run(settings: Settings) -> None:
        seen.append(settings)

    from rlproxy.cli import processes

    monkeypatch.setattr(processes, "run_trainer", fake_run)
    out = runner.invoke(
        main.app, ["train", "--upstream", "http://127.0.0.1:1", "--loss", "dapo", "--lora-r", "4"]
    )
    assert out.exit_code == 0, out.output
    assert seen[0].loss == "dapo" and seen[0].lora_r == 4


def test_unknown_option_that_is_a_setting_says_how_to_set_it():
    out = runner.invoke(main.app, ["sft", "--policy", "p", "--file", "x.jsonl", "--report-to", "tensorboard"])
    assert out.exit_code == 2
    assert "--report-to is the setting report_to: set RLPROXY_REPORT_TO" in out.output
    assert "--port" not in out.output.split("error:")[1].split("(see")[0]  # no misleading suggestion


def test_flags_show_no_bool_type(monkeypatch):
    import typer.rich_utils

    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 1000)
    text = runner.invoke(main.app, ["serve", "--help-all"]).output
    assert "<bool>" not in text and "--learning-rate" in text and "RLPROXY_REPORT_TO" in text
