"""What `train` checks of the model's files before Ray starts (issue 28 item 5): the policy's
architecture and the config values Megatron cannot reproduce (the registry's own check, the one
the converter and the planner run), readable weights (every safetensors header read, a truncated
file found by its size), and tokenizer files. Each problem is one ConfigError naming the key."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from rlhf_megatron.errors import CheckpointError, ConfigError
from rlhf_megatron.models import ARCHITECTURES
from rlhf_megatron.models.checkpoint_meta import hf_assets_dir, is_megatron_checkpoint
from rlhf_megatron.models.hf_checkpoint import HFCheckpoint, read_safetensors_layout
from rlhf_megatron.records.metrics import wandb_missing

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""Any one of them makes a directory a tokenizer AutoTokenizer can load."""


def check_model_files(cfg: Any, hf_config: Any) -> None:
    """The checks above for model.path (and the weights of critic.path and reward_model.path);
    `hf_config` is the policy's config.json."""

    try:
        ARCHITECTURES.for_hf_config(hf_config)
    except ConfigError as exc:
        raise ConfigError(f"model.path={cfg.model.path}: {exc}") from None
    critic = (cfg.critic.path or cfg.model.path) if cfg.uses_critic else None
    for key, path in (("model.path", cfg.model.path), ("critic.path", critic),
                      ("reward_model.path", cfg.reward_model.path)):
        if path is not None and not is_megatron_checkpoint(path):
            _check_weights(key, Path(path))
    tokenizer = Path(cfg.model.tokenizer_path or hf_assets_dir(cfg.model.path))
    if not any((tokenizer / name).is_file() for name in TOKENIZER_FILES):
        key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
        raise ConfigError(f"{key}={tokenizer}: no tokenizer files (one of "
                          f"{', '.join(TOKENIZER_FILES)}); set model.tokenizer_path")


def _check_weights(key: str, path: Path) -> None:

    try:
        checkpoint = HFCheckpoint(path, check_shapes=False)
        for file in checkpoint.files():
            read_safetensors_layout(file)
    except CheckpointError as exc:
        raise ConfigError(f"{key}={path}: {exc}") from None


def check_metrics_sinks(cfg: Any) -> None:
    """An optional sink that is not installed, found now rather than after the workers start."""
    if cfg.metrics.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(wandb_missing(cfg.metrics.wandb_project))
