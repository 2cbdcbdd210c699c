"""`${...}` interpolation in configs and overrides (resolved by OmegaConf, checked by the schema)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.config import load_config, save_config
from rlhf_megatron.errors import ConfigError


def test_interpolation_in_yaml_overrides_and_text(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  seed: 7\n  run_dir: runs/seed_${trainer.seed}\n"
                    "  total_steps: ${actor.layout.tp}\nactor:\n  layout: {tp: 2}\n")
    monkeypatch.setenv("RLHF_TEST_LR", "3e-6")
    cfg = load_config(path, ["actor.engine.optimizer.lr=${oc.env:RLHF_TEST_LR}",
                             "trainer.val_every=${trainer.seed}"])
    assert cfg.trainer.run_dir == "runs/seed_7"
    assert cfg.trainer.total_steps == 2 and cfg.trainer.val_every == 7
    assert cfg.actor.engine.optimizer.lr == 3e-6  # a resolved string is type-checked as written


def test_interpolation_of_a_default_and_escaping(tmp_path: Path) -> None:
    default_seed = load_config(None).trainer.seed
    cfg = load_config(None, ["trainer.run_dir=out_${trainer.seed}",
                             r"model.tokenizer_path=\${literal}"])
    assert cfg.trainer.run_dir == f"out_{default_seed}"
    assert cfg.model.tokenizer_path == "${literal}"
    save_config(cfg, tmp_path / "resolved.yaml")  # the literal survives a save and a load
    assert load_config(tmp_path / "resolved.yaml") == cfg


@pytest.mark.parametrize("override, message", [
    ("trainer.run_dir=${trainer.sed}",
     "config key 'trainer.run_dir': the interpolation ${trainer.sed} names no key "
     "(did you mean 'trainer.seed'?)"),
    ("trainer.total_steps=${trainer.run_dir}", "trainer.total_steps must be an integer"),
])
def test_bad_interpolations_are_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value) and "\n" not in str(info.value)
