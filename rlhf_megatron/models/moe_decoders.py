"""The supported mixture-of-experts families (registered next to the dense ones in decoders.py).

Each is its dense baseline (Qwen3: q/k norm, Qwen2: q/k/v bias, Mixtral: Mistral) with sparse MLP
layers; what routes how is translated in models/moe_config.py, names in mapping_tables.py.
GLM-4.5 is Llama-like attention with q/k/v biases (`attention_bias`, o_proj unbiased), optional
per-head q/k norm (`use_qk_norm`) and partial RoPE (`partial_rotary_factor`), with a DeepSeek-V3
style sigmoid router. Its multi-token-prediction layers (`num_nextn_predict_layers`) are not
built or trained: HF's model skips them too, and a checkpoint's copy of them is left unread.
"""

from __future__ import annotations

from typing import Any

from rlhf_megatron.models.decoders import _check_llama, _check_llama_like, _check_qwen3
from rlhf_megatron.models.gpt_oss import check_gpt_oss
from rlhf_megatron.models.mapping_tables import gpt_oss_table_for, moe_table_for
from rlhf_megatron.models.moe_config import moe_shape
from rlhf_megatron.models.registry import ARCHITECTURES, ArchitectureSpec, require


def _check_moe(cfg: Any) -> None:
    # Refuses what Megatron's router cannot reproduce, naming the field. (`output_router_logits`
    # only switches HF's own loss term on; the aux loss here follows router_aux_loss_coef.)
    moe_shape(cfg)


def _check_qwen3_moe(cfg: Any) -> None:
    _check_qwen3(cfg)
    _check_moe(cfg)


def _check_qwen2_moe(cfg: Any) -> None:
    _check_llama_like(cfg)
    _check_moe(cfg)
    require(
        int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0) > 0,
        "shared_expert_intermediate_size must be > 0 for Qwen2MoeForCausalLM",
    )


def _check_mixtral(cfg: Any) -> None:
    _check_llama(cfg)
    _check_moe(cfg)


QWEN3_MOE = ARCHITECTURES.register(
    ArchitectureSpec("Qwen3MoeForCausalLM", qkv_bias=lambda cfg: False, qk_layernorm=True,
                     check_config=_check_qwen3_moe, mapping_table=moe_table_for)
)
MIXTRAL = ARCHITECTURES.register(
    ArchitectureSpec("MixtralForCausalLM", qkv_bias=lambda cfg: False,
                     check_config=_check_mixtral, mapping_table=moe_table_for)
)
QWEN2_MOE = ARCHITECTURES.register(
    ArchitectureSpec("Qwen2MoeForCausalLM", qkv_bias=lambda cfg: True,
                     check_config=_check_qwen2_moe, mapping_table=moe_table_for)
)


def _check_glm4_moe(cfg: Any) -> None:
    _check_llama_like(cfg)
    _check_moe(cfg)


GLM4_MOE = ARCHITECTURES.register(
    ArchitectureSpec("Glm4MoeForCausalLM", qkv_bias=lambda cfg: bool(cfg.attention_bias),
                     qk_layernorm=lambda cfg: bool(cfg.use_qk_norm),
                     check_config=_check_glm4_moe, mapping_table=moe_table_for)
)


def _check_deepseek_v3(cfg: Any) -> None:
    """DeepSeek-V3 (and Kimi-K2, the same architecture): MLA, the sigmoid router."""
    _check_llama_like(cfg)
    _check_moe(cfg)
    require(not getattr(cfg, "attention_bias", False),
            "attention_bias=True is unsupported for DeepseekV3ForCausalLM (Megatron's MLA "
            "projections have no biases)")
    require(getattr(cfg, "scoring_func", "sigmoid") == "sigmoid",
            f"scoring_func={getattr(cfg, 'scoring_func', None)!r} is unsupported (sigmoid only)")
    require(getattr(cfg, "topk_method", "noaux_tc") == "noaux_tc",
            f"topk_method={getattr(cfg, 'topk_method', None)!r} is unsupported (noaux_tc only: "
            "the expert bias decides the choice)")
    # HF builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, Megatron with the
    # model's rms_norm_eps.
    require(float(cfg.rms_norm_eps) == 1e-6,
            f"rms_norm_eps={cfg.rms_norm_eps} is unsupported for DeepseekV3ForCausalLM: its "
            "latent norms use eps 1e-6, Megatron uses rms_norm_eps for them too")


DEEPSEEK_V3 = ARCHITECTURES.register(
    ArchitectureSpec("DeepseekV3ForCausalLM", qkv_bias=lambda cfg: False,
                     qk_layernorm=lambda cfg: True,  # MLA's q_a / kv_a latent norms
                     check_config=_check_deepseek_v3, mapping_table=moe_table_for)
)


def _check_gpt_oss(cfg: Any) -> None:
    """gpt-oss: sinks, alternating sliding windows, biases everywhere, the clamped SwiGLU
    (models/gpt_oss.py); its router in models/moe_config.py."""
    check_gpt_oss(cfg)
    _check_moe(cfg)


GPT_OSS = ARCHITECTURES.register(
    ArchitectureSpec("GptOssForCausalLM", qkv_bias=lambda cfg: True,
                     check_config=_check_gpt_oss, mapping_table=gpt_oss_table_for)
)
