"""Engine settings: the optimizer, the LR schedule and how batches become micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.lora_settings import LoraSettings

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class OptimizerSettings:
    name: str = "adam"
    """'adam' (Megatron's Adam with decoupled weight decay, i.e. AdamW) or 'sgd'."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the cosine decay."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad: float = 1.0
    """Global grad-norm clip (0 disables)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to `lr` over this many optimizer steps."""
    total_steps: int = 1_000_000
    """Steps of the decay schedule (after warm-up)."""
    lr_decay_style: str = "constant"
    """'constant' or 'cosine'."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP where it works: on CUDA and with Adam (Megatron's
    distributed optimizer supports Adam only); elsewhere the plain optimizer is used."""
    cpu_offload: bool = False
    """GPU: keep the fp32 master weights and Adam moments on the host and step them there
    (Megatron's `optimizer_cpu_offload`, all of them: offload fraction 1). Needs Adam and the
    distributed optimizer; a no-op on CPU. Not run in this repository (no GPU)."""

    def validate(self) -> None:
        if self.cpu_offload and (self.name != "adam" or not self.use_distributed_optimizer):
            raise ConfigError("optimizer.cpu_offload needs name: adam and "
                              "use_distributed_optimizer: true")
        if self.name not in ("adam", "sgd"):
            raise ConfigError(f"optimizer.name={self.name!r}: expected 'adam' or 'sgd'")
        if self.lr_decay_style not in ("constant", "cosine"):
            raise ConfigError(
                f"optimizer.lr_decay_style={self.lr_decay_style!r}: expected 'constant' or 'cosine'"
            )
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optimizer.lr={self.lr}, min_lr={self.min_lr}: need 0 <= min_lr <= lr, lr > 0")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ConfigError(
                f"optimizer.warmup_steps={self.warmup_steps}, total_steps={self.total_steps}: "
                "need warmup_steps >= 0 and total_steps >= 1"
            )


def distributed_optimizer_enabled(settings: OptimizerSettings, platform: Any) -> bool:
    """Whether the engine builds Megatron's distributed optimizer: asked for, supported by the
    platform (`platform.supports_distributed_optimizer`: CUDA) and Adam. Megatron 0.16.1 asserts
    "Only Adam and HybridDeviceOptimizer currently supported" for anything else, so SGD runs use
    the plain optimizer (state replicated over DP) instead."""
    return (
        settings.use_distributed_optimizer
        and bool(platform.supports_distributed_optimizer)
        and settings.name == "adam"
    )


DEFAULT_LOGITS_CHUNK_TOKENS = 2048
"""Token positions per chunk of logits (docs/BENCHMARKS.md, "Chunked logits", for the choice)."""

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""Megatron's TransformerConfig.cp_comm_type values (TE attention)."""


@dataclass(frozen=True)
class EngineConfig:
    micro_batch_size: int = 1
    """Rows per micro-batch when `max_tokens_per_micro_batch` is not set."""
    max_tokens_per_micro_batch: int | None = None
    """Dynamic micro-batching: group rows so each micro-batch holds at most this many tokens."""
    use_packing: bool = False
    """Remove padding: pack the rows of a micro-batch into one sequence (block-diagonal mask)."""
    dtype: str = "fp32"
    """'fp32', or 'bf16': bf16 params for the forward, fp32 main grads/params in the optimizer (on
    GPU and on CPU). The actor's must be the rollout's (docs/ROLLOUT_AND_REFIT.md)."""
    recompute_activations: bool = False
    """Full activation recompute (uniform, one layer at a time)."""
    max_sequence_length: int | None = None
    """Longest prompt+response; defaults to the model's max_position_embeddings."""
    seed: int = 1234
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    cp_comm_type: str = "p2p"
    """Context parallelism through TE attention: 'p2p' (K/V ring, overlapped), 'all_gather',
    'a2a' (Ulysses: heads / tp must divide by cp) or 'a2a+p2p'. Without TE the SDPA attention
    always all-gathers K/V (models/sdpa_cp.py)."""
    routing_replay: bool = False
    """MoE actors: record each token's experts in the old-log-prob forward (batch field
    routed_experts) and route the update's forward through exactly those (models/moe_replay.py).
    Turns the on-policy shortcut off (the recording needs that forward)."""
    moe_aux_loss_coeff: float | None = None
    """MoE: the load-balancing loss coefficient (default: the HF config's router_aux_loss_coef)."""
    logits_chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS
    """Actor and reference: read log-probs and entropy out of the final hidden states this many
    token positions at a time (engines/chunked_logprobs.py), so that no pass holds more than one
    chunk's (tokens, vocab / tp) logits, in the forward or the backward. A micro-batch with at
    most this many positions (per CP rank) takes the unchunked path unchanged. 0: always the
    unchunked path (the whole micro-batch's logits)."""
    lora: LoraSettings | None = None
    """Actor only: train LoRA adapters (models/lora.py) instead of the whole model: the base is
    frozen, only the adapters have gradients and optimizer state, the reference policy is the
    actor with its adapters off (no reference engine), and exports and refits send the merged
    weights. Unset: full fine-tuning."""

    @property
    def params_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def validate(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"engine.dtype={self.dtype!r}: expected one of {sorted(_DTYPES)}")
        if self.micro_batch_size < 1:
            raise ConfigError(f"engine.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ConfigError(
                f"engine.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 1"
            )
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ConfigError(f"engine.cp_comm_type={self.cp_comm_type!r}: expected one of "
                              f"{list(CP_COMM_TYPES)}")
        if self.logits_chunk_tokens < 0:
            raise ConfigError(f"engine.logits_chunk_tokens={self.logits_chunk_tokens} must be >= 0 "
                              "(0: unchunked logits)")
        if self.moe_aux_loss_coeff is not None and not self.moe_aux_loss_coeff >= 0:
            raise ConfigError(f"engine.moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0")
        self.optimizer.validate()
        if self.lora is not None:
            self.lora.validate()
