"""The supported HF decoder families. Each entry is what differs from the Llama baseline.

Baseline (all four): RMSNorm pre-norm, RoPE (rotate-half, not interleaved), SwiGLU MLP without
biases, GQA, optional tied embeddings.
"""

from __future__ import annotations

from typing import Any

from rlhf_megatron.models.mapping_tables import llama_like_table_for
from rlhf_megatron.models.registry import ARCHITECTURES, ArchitectureSpec, require


def _check_llama_like(cfg: Any) -> None:
    require(
        getattr(cfg, "hidden_act", "silu") == "silu",
        f"hidden_act={getattr(cfg, 'hidden_act', None)!r} is unsupported (SwiGLU with 'silu' only)",
    )
    require(
        not getattr(cfg, "mlp_bias", False),
        "mlp_bias=True is unsupported (Megatron's add_bias_linear would also bias o_proj)",
    )


def _check_llama(cfg: Any) -> None:
    _check_llama_like(cfg)
    # Llama's attention_bias biases o_proj too; Megatron's add_qkv_bias covers q/k/v only.
    require(
        not getattr(cfg, "attention_bias", False),
        "attention_bias=True is unsupported for LlamaForCausalLM (it biases o_proj as well)",
    )


def _check_qwen3(cfg: Any) -> None:
    _check_llama_like(cfg)
    require(
        not getattr(cfg, "attention_bias", False),
        "attention_bias=True is unsupported for Qwen3ForCausalLM (it biases o_proj as well)",
    )


LLAMA = ARCHITECTURES.register(
    ArchitectureSpec("LlamaForCausalLM", qkv_bias=lambda cfg: False, check_config=_check_llama,
                     mapping_table=llama_like_table_for)
)
MISTRAL = ARCHITECTURES.register(
    ArchitectureSpec("MistralForCausalLM", qkv_bias=lambda cfg: False, check_config=_check_llama,
                     mapping_table=llama_like_table_for)
)
# Qwen2 always biases q/k/v (and never o_proj), whatever the config says.
QWEN2 = ARCHITECTURES.register(
    ArchitectureSpec("Qwen2ForCausalLM", qkv_bias=lambda cfg: True, check_config=_check_llama_like,
                     mapping_table=llama_like_table_for)
)
QWEN3 = ARCHITECTURES.register(
    ArchitectureSpec(
        "Qwen3ForCausalLM", qkv_bias=lambda cfg: False, qk_layernorm=True, check_config=_check_qwen3,
        mapping_table=llama_like_table_for,
    )
)
