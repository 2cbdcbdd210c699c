"""The gpt-oss mapping table: HF `GptOssForCausalLM` names and layouts <-> Megatron's.

HF keeps each layer's experts fused, in memory and in its checkpoints, transposed against
nn.Linear and with gate and up interleaved (`GptOssExperts`):
- `mlp.experts.gate_up_proj` (E, H, 2F): column 2f is gate f, column 2f + 1 is up f;
  `gate_up_proj_bias` (E, 2F) interleaved the same way;
- `mlp.experts.down_proj` (E, F, H) (out = x @ down + bias), `down_proj_bias` (E, H).
Megatron's SequentialMLP holds per expert `linear_fc1.weight` (2F / tp, H) = [gate_r; up_r]
(this TP rank's chunk of gate, then of up), `linear_fc1.bias` (2F / tp,) alike, `linear_fc2.weight`
(H, F / tp) (row-parallel) and `linear_fc2.bias` (H,), replicated.

- `FusedExpertMapping`: one expert's Megatron tensor <-> its slice [e] of the fused HF tensor
  (the direct load reads expert e's rows only; the refit sends `...mlp.experts.<e>.<name>`,
  the per-expert names vLLM's gpt-oss loader streams into its fused experts).
- `StackedFusedExpertsMapping`: the dist-checkpoint's `mlp.experts.experts.*` (E, ...) <-> the
  whole fused HF tensor (the converter).
The rest is the Llama-like table with q/k/v biases, plus o_proj's bias, the sinks
(`self_attn.sinks` <-> `core_attention.softmax_offset`, split by head) and the biased router.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rlhf_megatron.models.megatron_layout import tp_range
from rlhf_megatron.models.param_mapping import (
    ColumnParallelMapping,
    DirectMapping,
    ParamMapping,
    ShardContext,
    Sliceable,
)

_M = "decoder.layers.*."
_H = "model.layers.*."
# Megatron tensor of one expert -> the fused HF tensor it is a slice of.
_EXPERT_TENSORS = {"linear_fc1.weight": "gate_up_proj", "linear_fc1.bias": "gate_up_proj_bias",
                   "linear_fc2.weight": "down_proj", "linear_fc2.bias": "down_proj_bias"}


def _split_interleaved(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2n] with gate/up interleaved on the last dim -> (gate, up), each [..., n]. (Raises
    on the converter's row tracers, whose last dim is 1: this is no move of whole rows.)"""
    pairs = x.unflatten(-1, (-1, 2))
    return pairs[..., 0], pairs[..., 1]


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Inverse of `_split_interleaved`: [..., n] twice -> [..., 2n]."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def hf_expert_to_megatron(tensor: str, hf: torch.Tensor, ctx: ShardContext) -> torch.Tensor:
    """One expert's HF tensor (its slice [e]) -> this TP rank's Megatron shard of `tensor`.

    fc1 weight (H, 2F) -> (2F / tp, H); fc1 bias (2F,) -> (2F / tp,); fc2 weight (F, H) ->
    (H, F / tp); fc2 bias (H,) -> (H,).
    """
    if tensor == "linear_fc2.bias":
        return hf.clone()
    if tensor == "linear_fc2.weight":
        start, stop = tp_range(hf.shape[0], tp=ctx.tp, rank=ctx.rank)
        return hf[start:stop].t().contiguous()
    start, stop = tp_range(hf.shape[-1] // 2, tp=ctx.tp, rank=ctx.rank)
    gate, up = _split_interleaved(hf[..., 2 * start:2 * stop])
    return torch.cat([gate, up], dim=-1).t().contiguous() if hf.dim() == 2 else torch.cat([gate, up])


def megatron_expert_to_hf(tensor: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of `hf_expert_to_megatron` over all TP ranks' shards (in rank order)."""
    if tensor == "linear_fc2.bias":
        return shards[0]
    if tensor == "linear_fc2.weight":
        return torch.cat(list(shards), dim=1).t().contiguous()
    halves = [shard.unflatten(0, (2, -1)) for shard in shards]  # [gate_r; up_r] per rank
    gate = torch.cat([h[0] for h in halves])
    up = torch.cat([h[1] for h in halves])
    if gate.dim() == 2:  # (F, H) -> (H, 2F)
        return _interleave(gate.t(), up.t()).contiguous()
    return _interleave(gate, up)


@dataclass(frozen=True)
class FusedExpertMapping(ParamMapping):
    """One expert's Megatron `tensor` (a key of _EXPERT_TENSORS) <-> its slice of the layer's
    fused HF tensor. Bound to the expert index by `MappingTable.resolve` (`bind`)."""

    tensor: str = ""
    expert: int | None = None

    def bind(self, indices: Sequence[str]) -> FusedExpertMapping:
        return dataclasses.replace(self, expert=int(indices[-1]))

    def exported_name(self, role: str, hf_name: str) -> str:
        # '<layer>.mlp.experts.gate_up_proj' -> '<layer>.mlp.experts.<e>.gate_up_proj'
        head, _, leaf = hf_name.rpartition(".")
        return f"{head}.{self.expert}.{leaf}"

    def hf_to_megatron(self, sources: Mapping[str, Sliceable], ctx: ShardContext) -> torch.Tensor:
        assert self.expert is not None, "an unbound expert mapping"
        return hf_expert_to_megatron(self.tensor, sources["weight"][self.expert:self.expert + 1][0],
                                     ctx)

    def megatron_to_hf(self, shards: Sequence[torch.Tensor], ctx: ShardContext
                       ) -> dict[str, torch.Tensor]:
        return {"weight": megatron_expert_to_hf(self.tensor, shards)}


@dataclass(frozen=True)
class StackedFusedExpertsMapping(ParamMapping):
    """The dist-checkpoint's experts of one layer, (E, *per-expert shard) <-> the fused HF
    tensor (E, ...)."""

    tensor: str = ""

    def hf_to_megatron(self, sources: Mapping[str, Sliceable], ctx: ShardContext) -> torch.Tensor:
        source = sources["weight"]
        return torch.stack([hf_expert_to_megatron(self.tensor, source[e:e + 1][0], ctx)
                            for e in range(int(source.shape[0]))])

    def megatron_to_hf(self, shards: Sequence[torch.Tensor], ctx: ShardContext
                       ) -> dict[str, torch.Tensor]:
        experts = shards[0].shape[0]
        return {"weight": torch.stack([megatron_expert_to_hf(self.tensor, [s[e] for s in shards])
                                       for e in range(experts)])}


def gpt_oss_expert_mappings() -> list[ParamMapping]:
    """Router, sinks, o_proj bias and the fused experts (per expert and stacked)."""
    sa, attn = f"{_M}self_attention.", f"{_H}self_attn."
    mappings: list[ParamMapping] = [
        DirectMapping(f"{sa}linear_proj.bias", f"{attn}o_proj.bias"),
        ColumnParallelMapping(f"{sa}core_attention.softmax_offset", f"{attn}sinks"),
        DirectMapping(f"{_M}mlp.router.weight", f"{_H}mlp.router.weight"),
        DirectMapping(f"{_M}mlp.router.bias", f"{_H}mlp.router.bias"),
    ]
    for tensor, hf_leaf in _EXPERT_TENSORS.items():
        hf = {"weight": f"{_H}mlp.experts.{hf_leaf}"}
        mappings += [
            FusedExpertMapping(f"{_M}mlp.experts.local_experts.*.{tensor}", hf, tensor=tensor),
            StackedFusedExpertsMapping(f"{_M}mlp.experts.experts.{tensor}", hf, tensor=tensor),
        ]
    return mappings
