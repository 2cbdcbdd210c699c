"""HF config -> Megatron TransformerConfig plus the GPTModel arguments.

`MegatronModelArgs` is everything needed to build the same network at any parallel layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.gpt_oss import (
    YarnRopeScaling,
    gpt_oss_transformer_kwargs,
    is_gpt_oss,
    yarn_rope_scaling,
)
from rlhf_megatron.models.moe_config import (
    is_moe_config,
    moe_shape,
    moe_transformer_kwargs,
    validate_moe_layout,
)
from rlhf_megatron.models.registry import ArchitectureSpec, uses_mla
from rlhf_megatron.parallel.dims import ParallelDims
from rlhf_megatron.platform import Platform, current_platform, transformer_engine_available

# Megatron-LM pads the vocabulary to a multiple of 128 * tp so each TP shard stays GEMM-friendly.
DEFAULT_VOCAB_DIVISOR = 128


@dataclass(frozen=True)
class MegatronModelArgs:
    """What `build_gpt_model` needs besides pre/post_process.

    vocab_size: the HF vocabulary size; padded_vocab_size: after padding for TP.
    """

    transformer_config: Any  # megatron.core.transformer.TransformerConfig
    vocab_size: int
    padded_vocab_size: int
    max_sequence_length: int
    rotary_base: float
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None
    tie_word_embeddings: bool
    use_te_spec: bool
    # Share of each head's dimensions that RoPE rotates (the first ones; GLM-4.5: 0.5).
    rotary_percent: float = 1.0

    @property
    def rope_scaling_factor(self) -> float | None:
        return None if self.rope_scaling is None else self.rope_scaling.factor


def pad_vocab_size(vocab_size: int, tp: int, divisor: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """Smallest multiple of divisor * tp that holds `vocab_size` (Megatron-LM's rule)."""
    multiple = divisor * tp
    return -(-vocab_size // multiple) * multiple


def head_dim_of(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim or hf_config.hidden_size // hf_config.num_attention_heads


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    # transformers >= 5 keeps RoPE settings in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 RoPE frequency scaling (HF `rope_type: "llama3"`), with the config's own values.

    Megatron-Core 0.16.1's `GPTModel(rope_scaling=True, rope_scaling_factor=f)` takes only the
    factor: its `RotaryEmbedding._apply_scaling` keeps low_freq_factor=1, high_freq_factor=4 and
    original_max_position_embeddings=8192 fixed. So the builder applies this instead
    (`build_gpt_model`), and every field of the HF config takes effect.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """(head_dim / 2,) inverse frequencies of plain RoPE -> the Llama 3.1 scaled ones.

        Wavelengths 2*pi/f shorter than original/high_freq_factor stay; longer than
        original/low_freq_factor are divided by `factor`; in between, f is interpolated between
        f / factor and f by smooth = (original / wavelength - low) / (high - low)
        (Meta's Llama 3.1 reference `apply_scaling`; HF `_compute_llama3_parameters`).
        """
        original = float(self.original_max_position_embeddings)
        wavelength = 2 * math.pi / inv_freq
        smooth = (original / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelength > original / self.low_freq_factor,
                             inv_freq / self.factor, interpolated)
        return torch.where(wavelength < original / self.high_freq_factor, inv_freq, scaled)


def _rope_scaling(params: dict[str, Any], *, yarn: bool = False
                  ) -> Llama3RopeScaling | YarnRopeScaling | None:
    """The RoPE frequency scaling of `params`: none, Llama 3.1's or (yarn: gpt-oss) YaRN's."""
    rope_type = params["rope_type"]
    if rope_type == "default":
        return None
    if yarn and rope_type == "yarn":
        return yarn_rope_scaling(params)
    if rope_type != "llama3":
        raise ConfigError(
            f"rope scaling {params!r} is unsupported (default or Llama 3.1 llama3 only)"
        )
    for field in ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings"):
        if params.get(field) is None:
            raise ConfigError(f"llama3 rope scaling needs rope_scaling.{field}; got {params!r}")
    scaling = Llama3RopeScaling(
        float(params["factor"]), float(params["low_freq_factor"]),
        float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]),
    )
    if scaling.factor <= 0 or scaling.original_max_position_embeddings <= 0:
        raise ConfigError(f"llama3 rope scaling needs factor and original context > 0: {params!r}")
    if not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
        raise ConfigError(
            "llama3 rope scaling needs 0 < rope_scaling.low_freq_factor < high_freq_factor; "
            f"got {params!r}"
        )
    return scaling


def _rotary_percent(params: dict[str, Any], head_dim: int) -> float:
    """HF `partial_rotary_factor` -> Megatron's rotary_percent (both rotate the first
    int(head_dim * factor) dimensions, rotate-half within them)."""
    factor = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    rotated = int(head_dim * factor)
    if not 0 < factor <= 1 or rotated % 2:
        raise ConfigError(f"partial_rotary_factor={factor} must be in (0, 1] and rotate an even "
                          f"number of the head's {head_dim} dimensions")
    return factor


# Multi-latent attention (DeepSeek-V3, Kimi-K2): HF field -> MLATransformerConfig field.
_MLA_FIELDS = {"q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
               "qk_nope_head_dim": "qk_head_dim", "qk_rope_head_dim": "qk_pos_emb_head_dim",
               "v_head_dim": "v_head_dim"}
# HF YaRN parameter -> Megatron's (its YarnRotaryEmbedding and MLA softmax scale).
_YARN_FIELDS = {"factor": "rotary_scaling_factor",
                "original_max_position_embeddings": "original_max_position_embeddings",
                "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
                "mscale_all_dim": "mscale_all_dim"}


def _mla_kwargs(hf_config: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """MLATransformerConfig's MLA and RoPE fields. Megatron's MLA de-interleaves the RoPE
    dimensions of each head before rotating them (`multi_latent_attention` in its rope_utils),
    which is HF's `rope_interleave=True` (the DeepSeek-V3 layout); RoPE type "rope" or "yarn"."""
    if not getattr(hf_config, "rope_interleave", True):
        raise ConfigError("rope_interleave=False is unsupported with multi-latent attention: "
                          "Megatron's MLA rotates interleaved RoPE dimensions only")
    kwargs: dict[str, Any] = {"multi_latent_attention": True,
                              "rotary_base": float(rope["rope_theta"]),
                              **{ours: getattr(hf_config, theirs)
                                 for theirs, ours in _MLA_FIELDS.items()}}
    rope_type = rope["rope_type"]
    if rope_type == "default":
        return {**kwargs, "rope_type": "rope"}
    if rope_type != "yarn":
        raise ConfigError(f"rope scaling {rope!r} is unsupported with multi-latent attention "
                          "(default or yarn only)")
    missing = [field for field in ("factor", "original_max_position_embeddings")
               if rope.get(field) is None]
    if missing:
        raise ConfigError(f"yarn rope scaling needs rope_scaling.{missing[0]}; got {rope!r}")
    yarn = {ours: float(rope[theirs]) for theirs, ours in _YARN_FIELDS.items()
            if rope.get(theirs) is not None}
    yarn["original_max_position_embeddings"] = int(yarn["original_max_position_embeddings"])
    return {**kwargs, "rope_type": "yarn", **yarn}


def _check_sliding_window(hf_config: Any, max_sequence_length: int) -> None:
    window = getattr(hf_config, "sliding_window", None)
    enabled = getattr(hf_config, "use_sliding_window", window is not None)
    if enabled and window is not None and window < max_sequence_length:
        raise ConfigError(
            f"sliding_window={window} < max_sequence_length={max_sequence_length}: sliding-window "
            f"attention is unsupported; set max_sequence_length <= {window}"
        )


def _moe_kwargs(hf_config: Any, dims: ParallelDims, *, is_cuda: bool) -> dict[str, Any]:
    """TransformerConfig MoE fields for an MoE architecture (models/moe_config.py), else {}."""

    if not is_moe_config(hf_config):
        if dims.ep > 1:
            raise ConfigError(f"ep={dims.ep} needs an MoE architecture; "
                              f"{list(hf_config.architectures)} has no experts")
        return {}
    shape = moe_shape(hf_config)
    validate_moe_layout(shape, tp=dims.tp, ep=dims.ep)
    return {"ffn_hidden_size": shape.dense_ffn, **moe_transformer_kwargs(shape, is_cuda=is_cuda)}


def hf_to_megatron_args(
    hf_config: Any,
    spec: ArchitectureSpec,
    dims: ParallelDims,
    *,
    params_dtype: torch.dtype = torch.float32,
    max_sequence_length: int | None = None,
    recompute_activations: bool = False,
    vocab_divisor: int = DEFAULT_VOCAB_DIVISOR,
    platform: Platform | None = None,
    cp_comm_type: str = "p2p",
    local_spec: bool = False,
) -> MegatronModelArgs:
    """Translate an HF decoder config into Megatron's config for layout `dims`.

    local_spec: keep Megatron's local (non-TE) layer spec even where TE is usable (LoRA: the
    adapters read a linear's input, which TE's fused norm+linear layers take un-normalised).

    cp_comm_type: how TE attention exchanges K/V when dims.cp > 1 (EngineConfig.cp_comm_type).
    """
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    platform = platform or current_platform()
    dims.validate_for_model(
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=hf_config.num_key_value_heads,
        num_layers=hf_config.num_hidden_layers,
    )
    if hf_config.intermediate_size % dims.tp:
        raise ConfigError(
            f"intermediate_size={hf_config.intermediate_size} is not divisible by tp={dims.tp}"
        )
    moe = _moe_kwargs(hf_config, dims, is_cuda=platform.is_cuda)
    ffn_hidden_size = moe.pop("ffn_hidden_size", hf_config.intermediate_size)
    max_sequence_length = max_sequence_length or hf_config.max_position_embeddings
    rope = _rope_parameters(hf_config)
    mla = _mla_kwargs(hf_config, rope) if uses_mla(hf_config) else {}
    gpt_oss = is_gpt_oss(hf_config)
    rope_scaling = None if mla else _rope_scaling(rope, yarn=gpt_oss)
    # The fields of Megatron's GPT layer that make it the architecture's, over the Llama-like
    # ones below: MLA's, or gpt-oss's (biases, clamped SwiGLU, sinks, windows: models/gpt_oss.py).
    arch_fields = dict(mla)
    if gpt_oss:
        arch_fields = gpt_oss_transformer_kwargs(
            hf_config, head_dim_of(hf_config),
            rope_scaling if isinstance(rope_scaling, YarnRopeScaling) else None, tp=dims.tp)
    else:
        _check_sliding_window(hf_config, max_sequence_length)
    # Multi-latent attention keeps the local spec (SDPA core attention) on GPU too: Megatron's TE
    # spec duplicates MLA's down-projections on every TP rank, which neither the mapping table
    # (column-parallel down-projections) nor models/mla_layers.py's TP gradient fix covers yet.
    # gpt-oss too: its sinks and sliding windows are built and checked in our SDPA attention only.
    use_te = (platform.is_cuda and transformer_engine_available() and not mla and not gpt_oss
              and not local_spec)
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1} if recompute_activations else {}
    fields = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim_of(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias(hf_config),
        qk_layernorm=spec.qk_norm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.pp > 1 else None,
        context_parallel_size=dims.cp,
        cp_comm_type=cp_comm_type if dims.cp > 1 else None,
        expert_model_parallel_size=dims.ep,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not platform.is_cuda,
        # Fused kernels exist only on CUDA (and mostly through TE/apex).
        bias_activation_fusion=use_te,
        bias_dropout_fusion=use_te,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Batched isend/irecv needs NCCL-style grouped p2p; gloo runs them one by one.
        batch_p2p_comm=platform.is_cuda,
        batch_p2p_sync=platform.is_cuda,
        # RL micro-batches differ in length; pipeline p2p then exchanges shapes first.
        # (Megatron ties this flag to the MoE dispatcher even for dense models.)
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        **recompute,
        **moe,
    )
    fields.update(arch_fields)
    config = (MLATransformerConfig if mla else TransformerConfig)(**fields)
    return MegatronModelArgs(
        transformer_config=config,
        vocab_size=hf_config.vocab_size,
        padded_vocab_size=pad_vocab_size(hf_config.vocab_size, dims.tp, vocab_divisor),
        max_sequence_length=max_sequence_length,
        rotary_base=float(rope["rope_theta"]),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        use_te_spec=use_te,
        rotary_percent=_rotary_percent(rope, head_dim_of(hf_config)),
    )
