"""Context-parallel SDPA attention without Transformer Engine: all-gather K/V, local queries.

Layout (data/packing.py `cp_token_indices`): each sequence is split into 2*cp equal chunks and CP
rank r holds chunks r and 2*cp-1-r, in that order (for packed THD input: per packed row, rows back
to back). Each rank

1. all-gathers K and V of its CP group (`all_gather_sequence`: forward all-gather along the
   sequence, backward reduce-scatter of dK and dV, so each rank gets the sum of every rank's
   gradient for its own keys);
2. puts the gathered tokens back in sequence order;
3. for each of its two query chunks (global chunk g of length c) runs SDPA against the keys
   [0, (g + 1) * c) of that sequence with a lower-right causal rule: query i of the chunk sits at
   position g*c + i and may attend keys j <= g*c + i.

Memory per rank: the gathered K/V (full sequence, ng heads) plus the SDPA working set of s/cp
queries. Communication: one all-gather of K and V per layer forward, one reduce-scatter back.
This is the "all_gather" CP flavour (Megatron's cp_comm_type="all_gather" for TE) written on
torch's SDPA; no ring/overlap.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf_megatron.data.packing import cp_token_indices


class _AllGatherSequence(torch.autograd.Function):
    """[n, ...] on each of the group's ranks -> [size * n, ...] (rank-major); backward sums the
    gradients of every rank and returns this rank's [n, ...] slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        local = local.contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        n = grad.shape[0] // size
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
            dist.all_reduce(grad, group=group)
            return grad[rank * n:(rank + 1) * n].clone(), None
        out = grad.new_empty((n, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=group)
        return out, None


def all_gather_sequence(local: Tensor, group: Any) -> Tensor:
    """Autograd all-gather along dim 0 over `group` (see _AllGatherSequence)."""
    return _AllGatherSequence.apply(local, group)


def sequence_order(lengths: list[int], cp: int) -> Tensor:
    """Index that turns the rank-major concatenation of every CP rank's tokens into sequence order:
    gathered[order] lists the tokens of `lengths` (back to back) in their original order."""
    held = torch.cat([cp_token_indices(lengths, cp, rank) for rank in range(cp)])
    return torch.argsort(held)


def _lower_right_causal(sq: int, sk: int, device: torch.device) -> Tensor:
    """bool [sq, sk], True = may attend: query i (the last sq of sk positions) sees keys
    j <= i + sk - sq."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


def _chunk_attention(
    sdpa: Any, q: Tensor, k: Tensor, v: Tensor, scale: float, dropout_p: float
) -> Tensor:
    """[b, np, c, hn] queries that are the last c of the sk key positions of [b, ng, sk, hn]."""
    sq, sk = q.shape[2], k.shape[2]
    if sq == sk:
        return sdpa(q, k, v, scale=scale, causal=True, dropout_p=dropout_p)
    allowed = _lower_right_causal(sq, sk, q.device)
    return sdpa(q, k, v, scale=scale, causal=True, allowed=allowed, dropout_p=dropout_p)


def cp_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    group: Any,
    sdpa: Any,
    cu_seqlens_padded: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Causal attention of this CP rank's queries over its group's whole sequences.

    Dense: query [s_local, b, np, hn], key/value [s_local, b, ng, hn] (s_local = 2 * c, the
        rank's two chunks of a sequence of 2*cp*c tokens) -> [s_local, b, np * hn].
    Packed (cu_seqlens_padded: int (n + 1,), the GLOBAL offsets of rows whose lengths are
        multiples of 2*cp): query [t_local, np, hn], key/value [t_local, ng, hn] -> [t_local, np*hn].
    sdpa: the attention call of models/sdpa_attention.py (`_sdpa`).
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    packed = cu_seqlens_padded is not None
    if packed:
        bounds = [int(x) for x in cu_seqlens_padded.tolist()]
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        # [t, heads, hn] -> [t, 1, heads, hn]: the dense layout with one batch column.
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    else:
        lengths = [cp * query.shape[0]]
    order = sequence_order(lengths, cp).to(query.device)
    # [cp * t_local, b, ng, hn] in sequence order; one gather for K and V together.
    kv = all_gather_sequence(torch.cat([key, value], dim=2), group).index_select(0, order)
    k_all, v_all = kv.split([key.shape[2], value.shape[2]], dim=2)
    outputs, local_start, global_start = [], 0, 0
    for length in lengths:
        chunk = length // (2 * cp)
        if chunk == 0:
            continue
        for half, g in enumerate((rank, 2 * cp - 1 - rank)):
            q = query[local_start + half * chunk: local_start + (half + 1) * chunk]
            end = global_start + (g + 1) * chunk
            k, v = k_all[global_start:end], v_all[global_start:end]
            # [s, b, heads, hn] -> [b, heads, s, hn]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            out = _chunk_attention(sdpa, q, k, v, scale, dropout_p)
            outputs.append(out.permute(2, 0, 1, 3))  # [c, b, np, hn]
        local_start += 2 * chunk
        global_start += length
    out = torch.cat(outputs)
    if packed:
        return out.reshape(out.shape[0], -1)
    return out.reshape(out.shape[0], out.shape[1], -1)
