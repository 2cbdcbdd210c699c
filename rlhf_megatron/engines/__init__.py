"""Megatron engines (no Ray): actor, reference, critic and reward model."""

from rlhf_megatron.engines.actor import ActorEngine, PolicyUpdateSettings, ReferenceEngine
from rlhf_megatron.engines.base import MegatronEngine, MicroBatch
from rlhf_megatron.engines.config import EngineConfig, OptimizerSettings

__all__ = [
    "ActorEngine",
    "EngineConfig",
    "MegatronEngine",
    "MicroBatch",
    "OptimizerSettings",
    "PolicyUpdateSettings",
    "ReferenceEngine",
]
