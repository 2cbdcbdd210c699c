"""LoRA settings (`actor.engine.lora`), apart from models/lora.py so that the config schema
imports no Megatron."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_megatron.errors import ConfigError

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LORA_REFITS = ("merged", "adapter")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM 0.32 accepts (vllm/config/lora.py MaxLoRARanks); an adapter
refit runs at the smallest that holds the rank (vLLM zero-pads a smaller adapter)."""
"""The decoder linears an adapter can go on (Megatron names; HF: q/k/v_proj, o_proj,
gate/up_proj, down_proj)."""


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    """r: the adapters' inner width."""
    alpha: float = 16.0
    """The update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in passes with gradients only (the base path has none).
    The default 0 keeps the update's own log-probs those of the sampled policy."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Which of linear_qkv, linear_proj, linear_fc1, linear_fc2 get adapters."""
    refit: str = "merged"
    """How each refit reaches the rollout engines (docs/LORA.md, "Refit"). 'merged' (the
    default): base + scale * B A under the base names, so vLLM runs a plain model at the base
    model's generation speed. 'adapter': only the adapters' bytes, into vLLM's own LoRA (one
    adapter, replaced in place at each refit); vLLM then applies the adapter at every step, which
    costs generation time (about 2x a decode step on the CPU tiny model) but moves megabytes a
    refit instead of the model, and in bf16 keeps W and B A apart as the trainer does."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"lora.rank={self.rank} must be >= 1")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if self.refit not in LORA_REFITS:
            raise ConfigError(f"lora.refit={self.refit!r}: expected one of {list(LORA_REFITS)}")
        if self.refit == "adapter" and self.rank > VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"lora.rank={self.rank} with lora.refit=adapter: vLLM's LoRA takes "
                              f"ranks up to {VLLM_LORA_RANKS[-1]}; use lora.refit: merged")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown or not self.target_modules:
            raise ConfigError(f"lora.target_modules={list(self.target_modules)}: expected a "
                              f"non-empty subset of {list(LORA_TARGETS)}")
