"""`validate_config(cfg)`: the up-front checks of a run's config, RL (validate.py) or offline
(offline_validate.py, SFT/DPO/KTO: the actor alone, no rollout); every check raises one
ConfigError naming the field, before Ray or any engine starts."""

from __future__ import annotations

from rlhf_megatron.config.offline_validate import validate_offline_config
from rlhf_megatron.config.schema import TrainConfig
from rlhf_megatron.config.validate import DevicePlan, validate_rl_config


def validate_config(cfg: TrainConfig, *, check_paths: bool = True) -> DevicePlan:
    """Check the whole config; return the device plan the controller will place.
    `check_paths=False` skips file-existence checks (planning a run for a cluster from a
    laptop)."""
    if cfg.is_offline:
        return validate_offline_config(cfg, check_paths=check_paths)
    return validate_rl_config(cfg, check_paths=check_paths)
