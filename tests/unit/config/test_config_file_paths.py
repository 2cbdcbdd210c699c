"""Config file paths (issue 28 item 6): a directory given as the config is named as one, and a
config's own reward file is found from any working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.cli import main
from rlhf_megatron.config import load_config, validate_config
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.rewards.custom import load_custom_reward

REPO = Path(__file__).resolve().parents[3]
LONG_CP = REPO / "configs" / "quickstart_long_cp_cpu.yaml"


def test_a_directory_as_config_is_named_a_directory(tmp_path, capsys):
    with pytest.raises(ConfigError, match=f"^config file {tmp_path} is a directory, not a YAML "
                                          "file$"):
        load_config(tmp_path)
    assert main(["train", "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"rlhf-megatron: error: config file {tmp_path} is a directory, not a YAML file"]


def test_long_cp_quickstart_reward_loads_from_another_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(LONG_CP)
    validate_config(cfg, check_paths=False)
    file, _, function = cfg.reward.custom_function.rpartition(":")
    assert Path(file) == REPO / "rlhf_megatron" / "rewards" / "positional.py"
    assert load_custom_reward(cfg.reward.custom_function)(["7 7"], ["7 8"]) == [0.5]


def test_reward_file_in_yaml_is_relative_to_the_yaml_and_overrides_to_the_cwd(tmp_path,
                                                                              monkeypatch):
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "run.yaml"
    config.write_text("reward:\n  custom_function: rewards/mine.py:score\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(config).reward.custom_function == \
        f"{tmp_path / 'configs' / 'rewards' / 'mine.py'}:score"
    assert load_config(config, ["reward.custom_function=mine.py:score"]) \
        .reward.custom_function == "mine.py:score"
    config.write_text("reward:\n  custom_function: /abs/mine.py:score\n")
    assert load_config(config).reward.custom_function == "/abs/mine.py:score"
