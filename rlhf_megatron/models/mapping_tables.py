"""Mapping tables for the Llama-like decoder families (Llama, Mistral, Qwen2, Qwen3).

Megatron names cover both layer specs: the local spec (separate `input_layernorm` /
`pre_mlp_layernorm`) and the Transformer Engine spec (norms fused into `linear_qkv` / `linear_fc1`
as `layer_norm_weight`). A model has one set or the other; the table holds both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_megatron.models.gpt_oss_mapping import gpt_oss_expert_mappings
from rlhf_megatron.models.moe_config import moe_shape
from rlhf_megatron.models.param_mapping import (
    ColumnParallelMapping,
    DirectMapping,
    GatedMLPMapping,
    MappingTable,
    ParamMapping,
    QKVMapping,
    RowParallelMapping,
    ShardContext,
    VocabParallelMapping,
)
from rlhf_megatron.models.registry import uses_mla

_M = "decoder.layers.*."  # Megatron layer prefix (global layer index)
_H = "model.layers.*."  # HF layer prefix


def mla_mappings() -> list[ParamMapping]:
    """Multi-latent attention (DeepSeek-V3): HF's low-rank q/kv projections and their norms.

    Row layouts agree, so each maps as a plain column- or row-parallel tensor: q_b_proj holds per
    head [nope; rope] dims (Megatron's linear_q_up_proj, split the same way), kv_b_proj per head
    [k_nope; v] (linear_kv_up_proj), kv_a_proj_with_mqa [latent; shared rope key]
    (linear_kv_down_proj). With the local spec the two down projections are column-parallel
    and gathered before their norms; the TE spec fuses the norms into the up projections
    (`layer_norm_weight`) and keeps the down projections whole."""
    attn, sa = f"{_H}self_attn.", f"{_M}self_attention."
    return [
        DirectMapping(f"{_M}input_layernorm.weight", f"{_H}input_layernorm.weight"),
        ColumnParallelMapping(f"{sa}linear_q_proj.weight", f"{attn}q_proj.weight"),
        ColumnParallelMapping(f"{sa}linear_q_down_proj.weight", f"{attn}q_a_proj.weight"),
        DirectMapping(f"{sa}q_layernorm.weight", f"{attn}q_a_layernorm.weight"),
        DirectMapping(f"{sa}linear_q_up_proj.layer_norm_weight", f"{attn}q_a_layernorm.weight"),
        ColumnParallelMapping(f"{sa}linear_q_up_proj.weight", f"{attn}q_b_proj.weight"),
        ColumnParallelMapping(f"{sa}linear_kv_down_proj.weight",
                              f"{attn}kv_a_proj_with_mqa.weight"),
        DirectMapping(f"{sa}kv_layernorm.weight", f"{attn}kv_a_layernorm.weight"),
        DirectMapping(f"{sa}linear_kv_up_proj.layer_norm_weight", f"{attn}kv_a_layernorm.weight"),
        ColumnParallelMapping(f"{sa}linear_kv_up_proj.weight", f"{attn}kv_b_proj.weight"),
        RowParallelMapping(f"{sa}linear_proj.weight", f"{attn}o_proj.weight"),
    ]


def _gqa_mappings() -> list[ParamMapping]:
    attn = f"{_H}self_attn."
    return [
        DirectMapping(f"{_M}input_layernorm.weight", f"{_H}input_layernorm.weight"),
        DirectMapping(f"{_M}self_attention.linear_qkv.layer_norm_weight",
                      f"{_H}input_layernorm.weight"),
        QKVMapping(f"{_M}self_attention.linear_qkv.weight",
                   q=f"{attn}q_proj.weight", k=f"{attn}k_proj.weight", v=f"{attn}v_proj.weight"),
        RowParallelMapping(f"{_M}self_attention.linear_proj.weight", f"{attn}o_proj.weight"),
    ]


def llama_like_table(*, qkv_bias: bool, qk_norm: bool, tied: bool,
                     mla: bool = False) -> MappingTable:
    """The table of a Llama-like decoder.

    qkv_bias: q/k/v projections have biases (Qwen2). qk_norm: per-head RMSNorm on q and k (Qwen3).
    tied: the output layer shares the embedding (HF writes no `lm_head.weight`).
    mla: multi-latent attention (`mla_mappings`) in place of the fused GQA projection.
    """
    attn, mlp = f"{_H}self_attn.", f"{_H}mlp."
    mappings: list[ParamMapping] = [
        VocabParallelMapping("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        DirectMapping("decoder.final_layernorm.weight", "model.norm.weight"),
        *(mla_mappings() if mla else _gqa_mappings()),
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
    mla = uses_mla(hf_config)
    return llama_like_table(
        qkv_bias=spec.qkv_bias(hf_config),
        qk_norm=False if mla else spec.qk_norm(hf_config),
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        mla=mla,
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
    "Glm4MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "DeepseekV3ForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
}
# The shared expert's HF module and, where it has one, its sigmoid gate.
_SHARED_EXPERT_NAMES = {
    "Qwen2MoeForCausalLM": ("mlp.shared_expert.", "mlp.shared_expert_gate.weight"),
    "Glm4MoeForCausalLM": ("mlp.shared_experts.", None),
    "DeepseekV3ForCausalLM": ("mlp.shared_experts.", None),
}
# The sigmoid router's fixed expert bias (Megatron's `expert_bias` buffer).
_EXPERT_BIAS_NAMES = {"Glm4MoeForCausalLM": "mlp.gate.e_score_correction_bias",
                      "DeepseekV3ForCausalLM": "mlp.gate.e_score_correction_bias"}


@dataclass(frozen=True)
class StackedExpertsMapping(ParamMapping):
    """All experts of one layer stacked on a leading axis <-> the per-expert HF tensors.

    This is how Megatron's SequentialMLP names its experts in the sharded state dict (a
    dist-checkpoint stores `mlp.experts.experts.linear_fc{1,2}.weight` with the global expert index
    as an axis): the converter reads or writes the (E, *per-expert shard) tensor, and `per_expert`
    (a GatedMLPMapping or RowParallelMapping over a `*` expert pattern) handles each expert.
    """

    per_expert: ParamMapping | None = None
    num_experts: int = 0

    def _expert_sources(self, sources: Mapping[str, Any], e: int) -> dict[str, Any]:
        return {role: sources[f"{role}@{e}"] for role in self.per_expert.hf}

    def hf_to_megatron(self, sources: Mapping[str, Any], ctx: ShardContext) -> torch.Tensor:
        return torch.stack([self.per_expert.hf_to_megatron(self._expert_sources(sources, e), ctx)
                            for e in range(self.num_experts)])

    def megatron_to_hf(self, shards: Sequence[torch.Tensor], ctx: ShardContext
                       ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for e in range(self.num_experts):
            tensors = self.per_expert.megatron_to_hf([shard[e] for shard in shards], ctx)
            out.update({f"{role}@{e}": tensor for role, tensor in tensors.items()})
        return out


def _stacked(megatron: str, per_expert: ParamMapping, num_experts: int) -> StackedExpertsMapping:
    # HF patterns: the per-expert pattern's last `*` (the expert) is filled in here, the layer `*`
    # by the table.
    hf = {}
    for role, pattern in per_expert.hf.items():
        head, _, tail = pattern.rpartition("*")
        for e in range(num_experts):
            hf[f"{role}@{e}"] = f"{head}{e}{tail}"
    return StackedExpertsMapping(megatron, hf, per_expert=per_expert, num_experts=num_experts)


def expert_mappings(architecture: str, num_experts: int = 0) -> list[ParamMapping]:
    """Router and per-expert mappings of an MoE architecture (sequential and grouped layouts)."""
    block, router, gate, up, down = _EXPERT_NAMES[architecture]
    hf_expert = f"{_H}{block}.experts.*."
    mappings: list[ParamMapping] = [
        DirectMapping(f"{_M}mlp.router.weight", f"{_H}{block}.{router}.weight"),
    ]
    for fc1, fc2 in (  # SequentialMLP, then TEGroupedMLP names
        (f"{_M}mlp.experts.local_experts.*.linear_fc1.weight",
         f"{_M}mlp.experts.local_experts.*.linear_fc2.weight"),
        (f"{_M}mlp.experts.linear_fc1.weight*", f"{_M}mlp.experts.linear_fc2.weight*"),
    ):
        mappings += [
            GatedMLPMapping(fc1, gate=f"{hf_expert}{gate}.weight", up=f"{hf_expert}{up}.weight"),
            RowParallelMapping(fc2, f"{hf_expert}{down}.weight"),
        ]
    if num_experts:  # the dist-checkpoint names (converter)
        fc1, fc2 = mappings[1], mappings[2]
        mappings += [_stacked(f"{_M}mlp.experts.experts.linear_fc1.weight", fc1, num_experts),
                     _stacked(f"{_M}mlp.experts.experts.linear_fc2.weight", fc2, num_experts)]
    if architecture in _SHARED_EXPERT_NAMES:
        module, gate_weight = _SHARED_EXPERT_NAMES[architecture]
        shared = f"{_H}{module}"
        mappings += [
            GatedMLPMapping(f"{_M}mlp.shared_experts.linear_fc1.weight",
                            gate=f"{shared}gate_proj.weight", up=f"{shared}up_proj.weight"),
            RowParallelMapping(f"{_M}mlp.shared_experts.linear_fc2.weight",
                               f"{shared}down_proj.weight"),
        ]
        if gate_weight:
            mappings.append(DirectMapping(f"{_M}mlp.shared_experts.gate_weight",
                                          f"{_H}{gate_weight}"))
    if architecture in _EXPERT_BIAS_NAMES:
        mappings.append(DirectMapping(f"{_M}mlp.router.expert_bias",
                                      f"{_H}{_EXPERT_BIAS_NAMES[architecture]}"))
    return mappings


def moe_table_for(spec: Any, hf_config: Any) -> MappingTable:
    """The Llama-like table of `spec` plus its router and expert mappings (dense layers of a
    Qwen-MoE model, `mlp_only_layers`, use the dense MLP entries)."""

    dense = llama_like_table_for(spec, hf_config)
    experts = moe_shape(hf_config).num_experts
    return MappingTable([*dense.mappings, *expert_mappings(spec.hf_architecture, experts)])


def per_expert_checkpoint_shapes(architecture: str, shapes: dict[str, Any]) -> dict[str, Any]:
    """HF in-memory parameter shapes -> the names and shapes an MoE checkpoint stores.

    transformers 5 holds each layer's experts fused in memory (`mlp.experts.gate_up_proj`
    (E, 2F, H) and `mlp.experts.down_proj` (E, H, F)) but writes and reads checkpoints per expert
    (`<block>.experts.<e>.<gate|up|down>.weight`; Mixtral's block is `block_sparse_moe` with
    w1/w3/w2). Other names pass through. Dense architectures are returned unchanged.
    """
    if architecture not in _EXPERT_NAMES:
        return shapes
    block, router, gate, up, down = _EXPERT_NAMES[architecture]
    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        prefix, _, leaf = name.rpartition(".mlp.")
        if not prefix:
            out[name] = shape
        elif leaf == "experts.gate_up_proj":
            experts, two_f, hidden = shape
            for e in range(experts):
                for role in (gate, up):
                    out[f"{prefix}.{block}.experts.{e}.{role}.weight"] = torch.Size((two_f // 2, hidden))
        elif leaf == "experts.down_proj":
            experts, hidden, ffn = shape
            for e in range(experts):
                out[f"{prefix}.{block}.experts.{e}.{down}.weight"] = torch.Size((hidden, ffn))
        elif leaf == f"{router}.weight":
            out[f"{prefix}.{block}.{router}.weight"] = shape
        else:
            out[name] = shape
    return out


def gpt_oss_table_for(spec: Any, hf_config: Any) -> MappingTable:
    """gpt-oss's table: the Llama-like one with q/k/v biases, plus `gpt_oss_expert_mappings`."""
    dense = llama_like_table(qkv_bias=True, qk_norm=False,
                             tied=bool(getattr(hf_config, "tie_word_embeddings", False)))
    return MappingTable([*dense.mappings, *gpt_oss_expert_mappings()])
