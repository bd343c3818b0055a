"""The settings written in groups (rlproxy/settings.py): flat names unchanged, each field in one group,
the settings below everything, and the judge and the trainer handed their groups."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlproxy.settings import GROUPS, JudgeSettings, Settings, TrainerSettings
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.judge import Judge


def test_every_field_is_in_exactly_one_group_in_the_docs_order() -> None:
    names = [name for _section, cls in GROUPS for name in cls.model_fields]
    assert len(names) == len(set(names))
    assert names == list(Settings.model_fields)
    assert {"judge_model", "group_size", "max_body_bytes", "db_url"} <= set(names)


def test_the_settings_import_nothing_of_ours() -> None:
    """settings.py is below everything: importing it loads no other rlproxy module."""
    code = (
        "import sys, rlproxy.settings; rlproxy.settings.Settings(rollout='a=canary'); "
        "print(sorted(m for m in sys.modules if m.startswith('rlproxy.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['rlproxy.settings']"


def test_names_read_the_same_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPROXY_JUDGE_MODEL", "m")
    monkeypatch.setenv("RLPROXY_GROUP_SIZE", "7")
    monkeypatch.setenv("RLPROXY_MAX_REWARD_BODY_BYTES", "2048")
    monkeypatch.setenv("RLPROXY_UPSTREAM", " http://a , http://b ")
    s = Settings()
    assert (s.judge_model, s.group_size, s.max_reward_body_bytes) == ("m", 7, 2048)
    assert s.upstream_urls == ["http://a", "http://b"]
    assert s.group(TrainerConfig).group_size == 7


def test_trainer_config_is_the_trainer_group() -> None:
    assert list(TrainerConfig.model_fields) == list(TrainerSettings.model_fields)
    config = Settings(group_size=5, api_key="secret").group(TrainerConfig)
    assert isinstance(config, TrainerConfig) and config.group_size == 5
    assert not hasattr(config, "api_key")  # a step's saved config holds no secrets


def test_the_judge_takes_its_group_whole() -> None:
    """The judge reads its settings group itself: no field copied under another name."""
    group = Settings(judge="always", judge_policies="a=off", judge_rubrics={"p": "rp"}).group(JudgeSettings)
    judge = Judge(group)
    assert judge.settings == group and judge.policies == {"a": "off"}
    assert [judge.mode_of("a"), judge.mode_of("x")] == ["off", "always"]
    assert [judge.rubric_of("p"), judge.rubric_of("q", "asked")] == ["rp", "asked"]
    assert not judge.off
    assert Judge(JudgeSettings(judge="off")).off
    assert not Judge(JudgeSettings(judge="off", judge_policies="a=always")).off
    with pytest.raises(ValueError, match="judge_policies"):
        Judge(JudgeSettings(judge_policies="nonsense"))
