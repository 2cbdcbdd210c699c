"""`train` finds what is wrong with the model's files before Ray starts (issue 28 item 5,
config/model_files.py): an architecture Megatron cannot reproduce, truncated weights, no weights,
no tokenizer, and a W&B sink without wandb. Each is one ConfigError naming the key."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from rlhf_megatron.config import load_config, validate_config
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf") / "model")


def _validate(model: Path, tmp_path: Path, *extra: str) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n' * 4)
    validate_config(load_config(None, [f"model.path={model}", f"data.train_files=[{train}]",
                                       "data.prompts_per_step=4", "rollout.sampling.n=4",
                                       "rollout.engine.max_model_len=256", "data.max_prompt_length=64",
                                       f"trainer.run_dir={tmp_path}/run", *extra]))


def _copy(tiny: Path, tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    return model


def test_the_tiny_model_passes(tiny: Path, tmp_path: Path) -> None:
    _validate(tiny, tmp_path)


def test_an_unsupported_activation_is_refused(tiny: Path, tmp_path: Path) -> None:
    model = _copy(tiny, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match=r"model.path=.*hidden_act='gelu' is unsupported"):
        _validate(model, tmp_path)


def test_truncated_or_missing_weights_are_refused(tiny: Path, tmp_path: Path) -> None:
    model = _copy(tiny, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ConfigError, match=r"model.path=.*corrupt safetensors file .*truncated"):
        _validate(model, tmp_path)
    weights.unlink()
    with pytest.raises(ConfigError, match=r"model.path=.*no model.safetensors"):
        _validate(model, tmp_path)


def test_no_tokenizer_is_refused(tiny: Path, tmp_path: Path) -> None:
    model = _copy(tiny, tmp_path)
    (model / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"model.path=.*no tokenizer files"):
        _validate(model, tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_wandb_is_refused(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="metrics.wandb_project='p' but wandb is not installed"):
        _validate(tiny, tmp_path, "metrics.wandb_project=p")
