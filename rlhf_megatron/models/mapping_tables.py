"""Mapping tables for the Llama-like decoder families (Llama, Mistral, Qwen2, Qwen3).

Megatron names cover both layer specs: the local spec (separate `input_layernorm` /
`pre_mlp_layernorm`) and the Transformer Engine spec (norms fused into `linear_qkv` / `linear_fc1`
as `layer_norm_weight`). A model has one set or the other; the table holds both.
"""

from __future__ import annotations

from typing import Any

from rlhf_megatron.models.param_mapping import (
    DirectMapping,
    GatedMLPMapping,
    MappingTable,
    ParamMapping,
    QKVMapping,
    RowParallelMapping,
    VocabParallelMapping,
)

_M = "decoder.layers.*."  # Megatron layer prefix (global layer index)
_H = "model.layers.*."  # HF layer prefix


def llama_like_table(*, qkv_bias: bool, qk_norm: bool, tied: bool) -> MappingTable:
    """The table of a Llama-like decoder.

    qkv_bias: q/k/v projections have biases (Qwen2). qk_norm: per-head RMSNorm on q and k (Qwen3).
    tied: the output layer shares the embedding (HF writes no `lm_head.weight`).
    """
    attn, mlp = f"{_H}self_attn.", f"{_H}mlp."
    mappings: list[ParamMapping] = [
        VocabParallelMapping("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        DirectMapping("decoder.final_layernorm.weight", "model.norm.weight"),
        DirectMapping(f"{_M}input_layernorm.weight", f"{_H}input_layernorm.weight"),
        DirectMapping(f"{_M}self_attention.linear_qkv.layer_norm_weight",
                      f"{_H}input_layernorm.weight"),
        QKVMapping(f"{_M}self_attention.linear_qkv.weight",
                   q=f"{attn}q_proj.weight", k=f"{attn}k_proj.weight", v=f"{attn}v_proj.weight"),
        RowParallelMapping(f"{_M}self_attention.linear_proj.weight", f"{attn}o_proj.weight"),
        DirectMapping(f"{_M}pre_mlp_layernorm.weight", f"{_H}post_attention_layernorm.weight"),
        DirectMapping(f"{_M}mlp.linear_fc1.layer_norm_weight",
                      f"{_H}post_attention_layernorm.weight"),
        GatedMLPMapping(f"{_M}mlp.linear_fc1.weight",
                        gate=f"{mlp}gate_proj.weight", up=f"{mlp}up_proj.weight"),
        RowParallelMapping(f"{_M}mlp.linear_fc2.weight", f"{mlp}down_proj.weight"),
    ]
    if qkv_bias:
        mappings.append(QKVMapping(f"{_M}self_attention.linear_qkv.bias",
                                   q=f"{attn}q_proj.bias", k=f"{attn}k_proj.bias",
                                   v=f"{attn}v_proj.bias"))
    if qk_norm:
        mappings += [
            DirectMapping(f"{_M}self_attention.q_layernorm.weight", f"{attn}q_norm.weight"),
            DirectMapping(f"{_M}self_attention.k_layernorm.weight", f"{attn}k_norm.weight"),
        ]
    if tied:
        # With PP > 1 the last stage holds its own copy of the embedding as `output_layer`.
        mappings.append(VocabParallelMapping("output_layer.weight", "model.embed_tokens.weight",
                                             export=False))
    else:
        mappings.append(VocabParallelMapping("output_layer.weight", "lm_head.weight"))
    return MappingTable(mappings)


def llama_like_table_for(spec: Any, hf_config: Any) -> MappingTable:
    """The table for `spec` (an ArchitectureSpec) and this HF config."""
    return llama_like_table(
        qkv_bias=spec.qkv_bias(hf_config),
        qk_norm=spec.qk_layernorm,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
