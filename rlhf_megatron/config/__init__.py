"""The training configuration: schema (dataclasses), YAML loading with overrides, validation."""

from rlhf_megatron.config.loader import config_to_dict, load_config, save_config
from rlhf_megatron.config.schema import (
    ActorSection,
    AlgorithmSection,
    CriticSection,
    DataSection,
    LayoutSpec,
    MetricsSection,
    ModelSection,
    RaySection,
    ResourcesSection,
    RewardModelSection,
    RolloutSection,
    TrainConfig,
    TrainerSection,
)
from rlhf_megatron.config.validate import DevicePlan, model_hf_config, plan_devices
from rlhf_megatron.config.validation import validate_config

__all__ = [
    "ActorSection", "AlgorithmSection", "CriticSection", "DataSection", "DevicePlan",
    "LayoutSpec", "MetricsSection", "ModelSection", "RaySection", "ResourcesSection",
    "RewardModelSection", "RolloutSection", "TrainConfig", "TrainerSection", "config_to_dict",
    "load_config", "model_hf_config", "plan_devices", "save_config", "validate_config",
]
