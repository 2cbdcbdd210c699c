"""Rollout settings and the start-up checks that catch bad ones before the first generate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.errors import ConfigError

# Attention head sizes vLLM's CPU backend implements (shared/docs/STACK.md); head_dim 16 starts
# but fails at the first generate, so it is refused here.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled (vLLM SamplingParams)."""

    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_tokens: int = 64
    """Longest response."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the tokenizer's EOS."""
    seed: int | None = None

    def validate(self) -> None:
        if self.n < 1 or self.max_tokens < 1:
            raise ConfigError(f"sampling n={self.n}, max_tokens={self.max_tokens}: both must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"sampling temperature={self.temperature}, top_p={self.top_p}: "
                "need temperature >= 0 and 0 < top_p <= 1"
            )

    def validate_for_training(self) -> None:
        """The checks of validate(), and a temperature > 0: every training log-prob is of
        softmax(logits / temperature) (data/sampling.py); greedy decoding has no such one."""
        self.validate()
        if self.temperature <= 0:
            raise ConfigError(f"temperature={self.temperature} is greedy decoding, which cannot "
                              "be trained on (no sampled distribution); set temperature > 0")


@dataclass(frozen=True)
class RolloutConfig:
    tensor_parallel_size: int = 1
    """vLLM TP (may differ from the actor's)."""
    max_model_len: int = 512
    """Longest prompt + response the engine accepts."""
    dtype: str = "float32"
    """'float32' or 'bfloat16' (the usual choice on GPU); the same as actor.engine.dtype, so that
    vLLM samples from the weights the actor trains (docs/ROLLOUT_AND_REFIT.md)."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of memory vLLM may take (weights + KV cache)."""
    cpu_kv_cache_gb: float = 1.0
    """CPU only: KV cache size in GiB, fractions allowed (vLLM's kv_cache_memory_bytes). vLLM
    zero-fills it at start-up, ~2-3 CPU-s a GiB: a tiny model needs far less (the CPU
    quickstarts' 2-layer model holds 64 Ki tokens in 0.0625). A VLLM_CPU_KVCACHE_SPACE in the
    environment (whole GiB, vLLM's older setting) overrides it."""
    enable_sleep_mode: bool = True
    """GPU only: sleep/wake around training (level below)."""
    sleep_level: int = 1
    """1: offload weights to CPU, drop KV cache; 2: drop both (weights come back by refit)."""
    seed: int = 0
    extra_engine_args: dict[str, Any] = field(default_factory=dict)
    lora_rank: int = 0
    """Set by the trainer, not by hand: actor.engine.lora's rank when its refit is 'adapter'
    (vLLM then runs with LoRA and receives only the adapters, rollout/vllm_lora.py); 0 otherwise."""
    lora_alpha: float = 0.0
    """Set with lora_rank: the adapter's alpha (vLLM scales B A by alpha / rank)."""

    def validate_for_model(self, hf_config: Any, *, on_cpu: bool) -> None:
        """Refuse at start-up what vLLM would only fail on later."""
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        tp = self.tensor_parallel_size
        if tp < 1 or heads % tp:
            raise ConfigError(f"rollout tensor_parallel_size={tp} does not divide {heads} attention heads")
        if kv_heads % tp and tp % kv_heads:
            raise ConfigError(f"rollout tensor_parallel_size={tp} does not fit {kv_heads} KV heads")
        max_positions = hf_config.max_position_embeddings
        if self.max_model_len > max_positions:
            raise ConfigError(
                f"rollout max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={max_positions}"
            )
        if on_cpu and head_dim not in CPU_HEAD_SIZES:
            raise ConfigError(
                f"head_dim={head_dim} is unsupported by vLLM's CPU attention; "
                f"supported: {', '.join(map(str, CPU_HEAD_SIZES))}"
            )
        if not self.cpu_kv_cache_gb > 0:
            raise ConfigError(f"rollout cpu_kv_cache_gb={self.cpu_kv_cache_gb} must be > 0 (GiB)")
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"rollout sleep_level={self.sleep_level}: expected 1 or 2")
