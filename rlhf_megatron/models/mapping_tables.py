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


# Mixture-of-experts tables (Qwen3-MoE, Qwen2-MoE, Mixtral). Megatron names: the router
# `mlp.router.weight`; experts in SequentialMLP (local spec and TE spec without grouped GEMM)
# `mlp.experts.local_experts.<e>.linear_fc{1,2}.weight`, or in TEGroupedMLP
# `mlp.experts.linear_fc{1,2}.weight<e>`; both with the *global* expert index e (the loaders add
# ep_rank * local experts to the local index: models/moe_layers.py `expert_offset_of`). Each
# expert's fc1 is [gate; up] split over (expert-)TP like a dense fc1, fc2 is row-parallel.
_EXPERT_NAMES = {
    # architecture -> (HF MoE block, router, gate, up, down)
    "Qwen3MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "Qwen2MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
}


def expert_mappings(architecture: str) -> list[ParamMapping]:
    """Router and per-expert mappings of an MoE architecture (sequential and grouped layouts)."""
    block, router, gate, up, down = _EXPERT_NAMES[architecture]
    hf_expert = f"{_H}{block}.experts.*."
    mappings: list[ParamMapping] = [
        DirectMapping(f"{_M}mlp.router.weight", f"{_H}{block}.{router}.weight"),
    ]
    for seq, fc1, fc2 in (
        (True, f"{_M}mlp.experts.local_experts.*.linear_fc1.weight",
         f"{_M}mlp.experts.local_experts.*.linear_fc2.weight"),
        (False, f"{_M}mlp.experts.linear_fc1.weight*", f"{_M}mlp.experts.linear_fc2.weight*"),
    ):
        mappings += [
            GatedMLPMapping(fc1, gate=f"{hf_expert}{gate}.weight", up=f"{hf_expert}{up}.weight"),
            RowParallelMapping(fc2, f"{hf_expert}{down}.weight"),
        ]
    if architecture == "Qwen2MoeForCausalLM":
        shared = f"{_H}mlp.shared_expert."
        mappings += [
            GatedMLPMapping(f"{_M}mlp.shared_experts.linear_fc1.weight",
                            gate=f"{shared}gate_proj.weight", up=f"{shared}up_proj.weight"),
            RowParallelMapping(f"{_M}mlp.shared_experts.linear_fc2.weight",
                               f"{shared}down_proj.weight"),
            DirectMapping(f"{_M}mlp.shared_experts.gate_weight",
                          f"{_H}mlp.shared_expert_gate.weight"),
        ]
    return mappings


def moe_table_for(spec: Any, hf_config: Any) -> MappingTable:
    """The Llama-like table of `spec` plus its router and expert mappings (dense layers of a
    Qwen-MoE model, `mlp_only_layers`, use the dense MLP entries)."""
    dense = llama_like_table_for(spec, hf_config)
    return MappingTable([*dense.mappings, *expert_mappings(spec.hf_architecture)])
