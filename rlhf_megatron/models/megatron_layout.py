"""Small pure functions for Megatron's sharded parameter layout.

Megatron marks tensor-parallel parameters with `tensor_model_parallel=True` and a
`partition_dim`; each TP rank holds one contiguous chunk along that dimension, except the gated
MLP's `linear_fc1`, where every rank holds [gate_r; up_r] (its chunk of gate, then its chunk of up).
Pipeline stages number their layers locally from 0; `TransformerLayer.layer_number` is the global,
1-based index.
"""

from __future__ import annotations

import re
from typing import Any

import torch

_LAYER_PREFIX = re.compile(r"^((?:module\.)*decoder\.layers\.)(\d+)\.")
_EXPERT_INDEX = re.compile(r"(experts\.local_experts\.|experts\.linear_fc[12]\.weight)(\d+)(\.|$)")


def tp_chunk(full: torch.Tensor, *, tp: int, rank: int, dim: int) -> torch.Tensor:
    """Rank `rank`'s contiguous chunk of `full` along `dim` (column/row/vocab-parallel split)."""
    if full.shape[dim] % tp:
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} is not divisible by tp={tp}")
    return full.chunk(tp, dim=dim)[rank]


def tp_merge(shards: list[torch.Tensor], *, dim: int) -> torch.Tensor:
    """Inverse of `tp_chunk` over all ranks."""
    return torch.cat(shards, dim=dim)


def tp_chunk_gated(full: torch.Tensor, *, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of a gated fc1 weight [gate; up] (dim 0): [gate_r; up_r]."""
    gate, up = full.chunk(2, dim=0)
    return torch.cat([tp_chunk(gate, tp=tp, rank=rank, dim=0), tp_chunk(up, tp=tp, rank=rank, dim=0)])


def tp_merge_gated(shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `tp_chunk_gated` over all ranks: back to [gate; up]."""
    halves = [shard.chunk(2, dim=0) for shard in shards]
    return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])


def resize_vocab_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim or zero-pad dim 0 of an embedding / output weight to `rows` (vocab padding)."""
    if weight.shape[0] >= rows:
        return weight[:rows]
    pad = weight.new_zeros((rows - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad])


def global_layer_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """'decoder.layers.<i>.x' -> 'decoder.layers.<i + offset>.x'; other names unchanged.

    expert_offset: this EP rank's first global expert; local expert indices of an MoE layer
    ('...experts.local_experts.<e>.' or TE grouped '...experts.linear_fc1.weight<e>') become global.
    """
    match = _LAYER_PREFIX.match(local_name)
    if not match:
        return local_name
    index = int(match.group(2)) + layer_offset
    rest = local_name[match.end():]
    if expert_offset:
        rest = _EXPERT_INDEX.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}"
                                 f"{m.group(3)}", rest)
    return f"{match.group(1)}{index}.{rest}"


# Buffers that a mapping table names besides the parameters: a sigmoid router's expert bias
# (DeepSeek-V3 / GLM-4.5 `e_score_correction_bias`). It is part of the model (it chooses the
# experts), so the direct load, the checkpoint export and the refit carry it like a weight; it has
# no gradient and no optimizer state.
MAPPED_BUFFERS = ("expert_bias",)


def mapped_tensors(module: Any) -> list[tuple[str, torch.Tensor]]:
    """(local name, tensor) of every parameter of `module` and of its MAPPED_BUFFERS."""
    named = list(module.named_parameters())
    named += [(name, buffer) for name, buffer in module.named_buffers()
              if name.rsplit(".", 1)[-1] in MAPPED_BUFFERS]
    return named


def layer_offset_of(model_chunk: Any) -> int:
    """Global index of this chunk's first decoder layer (0 when it holds none)."""
    module = getattr(model_chunk, "module", model_chunk)
    decoder = getattr(module, "decoder", None)
    layers = getattr(decoder, "layers", None) if decoder is not None else None
    if not layers:
        return 0
    return layers[0].layer_number - 1


def is_gated_fc1(name: str) -> bool:
    return name.endswith("mlp.linear_fc1.weight")


def shard_for_rank(
    full: torch.Tensor, param: torch.Tensor, *, name: str, tp: int, rank: int, gated: bool
) -> torch.Tensor:
    """This TP rank's shard of `full` for the Megatron parameter `param` called `name`."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    if gated and is_gated_fc1(name):
        return tp_chunk_gated(full, tp=tp, rank=rank)
    return tp_chunk(full, tp=tp, rank=rank, dim=param.partition_dim)


def interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_query_groups: int
) -> torch.Tensor:
    """Fuse HF q/k/v (weights or biases) into Megatron's per-query-group layout.

    q: (groups * heads_per_group * head_dim, *rest); k, v: (groups * head_dim, *rest).
    Returns (groups * (heads_per_group + 2) * head_dim, *rest), ordered for each group g as
    [q heads of g; k_g; v_g]. Works on a TP shard as well, with `num_query_groups` local groups.
    """
    rest = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(num_query_groups, -1, *rest),
            k.reshape(num_query_groups, -1, *rest),
            v.reshape(num_query_groups, -1, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def split_qkv(
    fused: torch.Tensor, *, num_query_groups: int, heads_per_group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `interleave_qkv`: (groups * (hpg + 2) * head_dim, *rest) -> (q, k, v)."""
    rest = fused.shape[1:]
    grouped = fused.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def tp_range(size: int, *, tp: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s contiguous chunk of a dimension of `size` split over tp."""
    if size % tp:
        raise ValueError(f"size {size} is not divisible by tp={tp}")
    step = size // tp
    return rank * step, (rank + 1) * step


def vocab_range(padded_vocab_size: int, vocab_size: int, *, tp: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of the real (unpadded) vocabulary held by rank `rank`.

    Megatron splits the *padded* vocabulary evenly; the last ranks may hold only padding, in which
    case start == stop.
    """
    start, stop = tp_range(padded_vocab_size, tp=tp, rank=rank)
    return min(start, vocab_size), min(stop, vocab_size)
