"""gpt-oss (`GptOssForCausalLM`): what differs from the other MoE families, as Megatron-Core
0.16.1 TransformerConfig fields (no Transformer Engine needed).

HF field (`GptOssConfig`) -> Megatron:
- every layer is MoE: `num_local_experts` experts of FFN `intermediate_size`, top
  `num_experts_per_tok`; the router is a biased linear whose top-k logits get a softmax over those
  k (Megatron's softmax router with pre_softmax=False, and its `bias` from add_bias_linear).
- experts: gate_up = x W + b with gate and up *interleaved* along the output (columns 0::2 and
  1::2; the mapping de-interleaves them into Megatron's [gate; up]); gate clamped above at
  `swiglu_limit`, up clamped to +-swiglu_limit; out = (up + 1) * gate * sigmoid(alpha * gate) ->
  activation_func=quick_gelu (x * sigmoid(1.702 x), so alpha must be 1.702), glu_linear_offset=1,
  activation_func_clamp_value=swiglu_limit (Megatron's MLP clamps the same way); the down
  projection's bias is scaled by the routing weight, as Megatron's expert MLP does.
- `attention_bias` (q/k/v/o biased) -> add_bias_linear (which biases every linear: the experts'
  and the router's too, all of which gpt-oss has).
- `sinks` (one logit per head) -> softmax_type="learnable" (`core_attention.softmax_offset`).
- `layer_types` / `sliding_window` (key j visible from query i when i - w < j <= i) ->
  window_size=(sliding_window - 1, 0) on the layers window_attn_skip_freq (a 0/1 list) marks.
- `rope_parameters` yarn (gpt-oss: factor 32 over 4096, beta 32 / 1, truncate=False) ->
  `YarnRopeScaling`: the builder sets HF's blended inverse frequencies, and the attention
  factor (0.1 ln(factor) + 1, which HF multiplies into cos and sin, so into q and k) becomes
  softmax_scale = factor^2 / sqrt(head_dim); sinks are not scaled, on either side.

Refused in one line: tp > 1 (Megatron-Core 0.16 asserts "Bias in Moe is only supported when
ETP==1", and expert-TP 1 under TP 2, experts whole on every TP rank, is not wired into the
mapping, the dispatcher's TP gradient fix or the refit here), attention_bias=False (add_bias_linear would bias the experts but not
q/k/v/o, or neither), swiglu_alpha != 1.702, a quantized checkpoint (MXFP4: dequantize it to
bf16 first), layer types other than sliding/full attention, a YaRN attention_factor given
explicitly together with mscale fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_megatron.errors import ConfigError, LayoutError

GPT_OSS = "GptOssForCausalLM"
# Megatron's quick_gelu is x * sigmoid(1.702 x), a constant.
QUICK_GELU_ALPHA = 1.702
_LAYER_TYPES = ("sliding_attention", "full_attention")


def is_gpt_oss(hf_config: Any) -> bool:
    return list(getattr(hf_config, "architectures", None) or []) == [GPT_OSS]


def check_gpt_oss(cfg: Any) -> None:
    """ConfigError for what the translation below cannot reproduce exactly."""
    quantization = getattr(cfg, "quantization_config", None)
    if quantization:
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", type(quantization).__name__))
        raise ConfigError(f"quantization_config ({method!r}) is unsupported for {GPT_OSS}: "
                          "dequantize the checkpoint to bf16 first")
    if not getattr(cfg, "attention_bias", True):
        raise ConfigError(f"attention_bias=False is unsupported for {GPT_OSS}: Megatron's "
                          "add_bias_linear biases q/k/v/o and the experts together")
    alpha = float(cfg.swiglu_alpha)
    if alpha != QUICK_GELU_ALPHA:
        raise ConfigError(f"swiglu_alpha={alpha} is unsupported for {GPT_OSS}: Megatron's "
                          f"quick_gelu fixes it at {QUICK_GELU_ALPHA}")
    bad = sorted(set(cfg.layer_types) - set(_LAYER_TYPES))
    if bad or len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ConfigError(f"layer_types={cfg.layer_types} must name one of {_LAYER_TYPES} per "
                          f"layer ({cfg.num_hidden_layers})")
    if "sliding_attention" in cfg.layer_types and not (cfg.sliding_window or 0) >= 1:
        raise ConfigError(f"sliding_window={cfg.sliding_window} must be >= 1 with "
                          "sliding_attention layers")


@dataclass(frozen=True)
class YarnRopeScaling:
    """HF's YaRN RoPE (`rope_type: "yarn"`, `_compute_yarn_parameters`) for GQA attention.

    Inverse frequencies: f_interp = f / factor and f_extrap = f blended per dimension pair d by
    the ramp r(d) = clamp((d - low) / (high - low), 0, 1): f_interp * r + f_extrap * (1 - r), where
    low / high are the dims at which beta_fast / beta_slow rotations fit the original context
    (floored / ceiled only when `truncate`). attention_factor multiplies cos and sin.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    attention_factor: float
    rope_theta: float

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """(head_dim / 2,) plain RoPE inverse frequencies -> YaRN's."""
        dim = 2 * inv_freq.shape[0]

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(self.rope_theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        # On inv_freq's device: a build under `torch.device("meta")` (the planner's check) makes
        # new tensors meta while Megatron's inv_freq is real.
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
                / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return inv_freq / self.factor * (1 - extrapolation) + inv_freq * extrapolation


def yarn_rope_scaling(rope: dict[str, Any]) -> YarnRopeScaling:
    """`YarnRopeScaling` from HF's rope parameters (ConfigError for missing fields)."""
    for field in ("factor", "original_max_position_embeddings"):
        if rope.get(field) is None:
            raise ConfigError(f"yarn rope scaling needs rope_parameters.{field}; got {rope!r}")
    factor = float(rope["factor"])
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else get_mscale(factor))
    return YarnRopeScaling(
        factor=factor, original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)), attention_factor=float(attention_factor),
        rope_theta=float(rope["rope_theta"]))


def gpt_oss_transformer_kwargs(cfg: Any, head_dim: int, yarn: YarnRopeScaling | None, *,
                               tp: int) -> dict[str, Any]:
    """The TransformerConfig fields that make Megatron's GPT layer gpt-oss's (module docstring);
    they override the Llama-like defaults of `hf_to_megatron_args`."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if tp > 1:
        raise LayoutError(f"tp={tp} is unsupported for {GPT_OSS}: Megatron-Core 0.16 allows "
                          "biased experts only at expert-TP 1 (use tp=1 with ep and pp)")

    sliding = [int(kind == "sliding_attention") for kind in cfg.layer_types]
    kwargs: dict[str, Any] = dict(
        add_bias_linear=True, add_qkv_bias=True, gated_linear_unit=True,
        activation_func=quick_gelu, glu_linear_offset=1.0,
        activation_func_clamp_value=float(cfg.swiglu_limit), softmax_type="learnable",
    )
    if any(sliding):
        kwargs.update(window_size=(int(cfg.sliding_window) - 1, 0), window_attn_skip_freq=sliding)
    if yarn is not None:
        kwargs["softmax_scale"] = yarn.attention_factor ** 2 / math.sqrt(head_dim)
    return kwargs
