"""Context parallelism in the engines: split a micro-batch's sequence across the CP group, and put
per-token results (log-probs, entropy, values) back together in sequence order.

Split (data/packing.py `cp_token_indices`): every sequence (each dense row of the micro-batch, or
each packed row) is padded at its end to a multiple of 2*cp; CP rank r keeps chunks r and
2*cp-1-r of each. The model runs on the kept tokens only; its attention exchanges K/V with the
other CP ranks (TE, or models/sdpa_cp.py).

Reassembly: each CP rank computes its tokens' values, `CpSplit.gather` all-gathers them and puts
them in sequence order, so every CP rank holds the whole micro-batch's values and computes the
same loss. In backward each rank keeps only the gradient of its own tokens (no sum over the CP
group): the CP ranks' parameter gradients are partial sums of that one loss's gradient, which
Megatron's DDP then sums over the DP x CP group (see MegatronEngine.loss_scale_for_sum).
The global token count of the loss normaliser is therefore unchanged by CP: the rows are not
split, only their tokens' computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlhf_megatron.data.packing import cp_token_indices


class _GatherTokens(torch.autograd.Function):
    """(b, t_local, ...) per CP rank -> (b, T, ...) in sequence order; backward: own tokens' grad."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, split: CpSplit) -> torch.Tensor:
        ctx.split = split
        local = local.contiguous()
        pieces = [torch.empty_like(local) for _ in range(split.size)]
        dist.all_gather(pieces, local, group=split.group)
        return torch.cat(pieces, dim=1).index_select(1, split.order.to(local.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        split = ctx.split
        return grad.index_select(1, split.index.to(grad.device)), None


@dataclass(frozen=True)
class CpSplit:
    """This CP rank's share of one micro-batch's (padded) sequence dimension.

    lengths: the padded sequence lengths laid back to back along dim 1 (one entry, the padded
        width, for dense rows; one per packed row).
    index: (T / cp,) int64 positions this rank holds; order: (T,) puts the rank-major
        concatenation of every rank's tokens back in sequence order.
    """

    lengths: tuple[int, ...]
    size: int
    rank: int
    index: torch.Tensor
    order: torch.Tensor
    group: Any

    @classmethod
    def build(cls, lengths: list[int], group: Any) -> CpSplit:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        held = [cp_token_indices(lengths, size, r) for r in range(size)]
        return cls(tuple(lengths), size, rank, held[rank], torch.argsort(torch.cat(held)), group)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """(b, T, ...) -> (b, T / cp, ...): this rank's tokens."""
        return full.index_select(1, self.index.to(full.device))

    def next_tokens(self, full_tokens: torch.Tensor) -> torch.Tensor:
        """(b, T) tokens -> (b, T / cp): the token after each of this rank's positions (0 after
        the last position of the whole row; those values are never used)."""
        shifted = torch.nn.functional.pad(full_tokens[:, 1:], (0, 1))
        return self.local(shifted)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(b, T / cp, ...) values of this rank's tokens -> (b, T, ...) of all, in order."""
        return _GatherTokens.apply(local, self)


def context_parallel_group() -> tuple[int, Any]:
    """(cp size, cp group) of the current layout."""
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    return size, (parallel_state.get_context_parallel_group() if size > 1 else None)


def tokens_per_cp_rank(mask: torch.Tensor, cp: int) -> torch.Tensor:
    """(b, s) 0/1 mask of one dense micro-batch -> (cp, b) int64: how many of each row's masked
    tokens every CP rank holds under the split of MegatronEngine._split_dense (the width padded
    to a multiple of 2*cp, rank r keeping chunks r and 2*cp-1-r). With the loss mask it says
    which CP ranks compute a row's response tokens (e.g. that a response is split across them)."""
    width = mask.shape[1]
    padded = -(-width // (2 * cp)) * (2 * cp)
    full = torch.nn.functional.pad(mask.long(), (0, padded - width))
    return torch.stack([full[:, cp_token_indices([padded], cp, r)].sum(1) for r in range(cp)])
