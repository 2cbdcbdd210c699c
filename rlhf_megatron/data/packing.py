"""Sequence packing (padding removal) and dynamic micro-batching by a token budget.

Packing concatenates the real tokens of several rows into one row of length T. Attention must not
cross row boundaries: on CPU (local attention) that is a block-diagonal causal mask; on GPU with
TE the same boundaries go to THD attention as cu_seqlens. RoPE is relative (a q.k score depends
only on the distance of the two positions), so positions need not restart per row for exactness,
but `position_ids` restart anyway for clarity and for absolute-position consumers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_megatron.errors import ConfigError


@dataclass(frozen=True)
class PackedRows:
    """Rows packed into one sequence.

    tokens: (1, T) int64, the real tokens of every row back to back (T = sum of lengths).
    position_ids: (1, T), restarting at 0 for each row.
    lengths: (n,) real length of each row; cu_seqlens: (n + 1,) int32 offsets, cu_seqlens[0] = 0.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def total(self) -> int:
        return int(self.tokens.shape[1])


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack right-padded rows (bs, S) into one (1, T) row of real tokens."""
    lengths = attention_mask.sum(-1).long()
    keep = attention_mask.bool()
    tokens = input_ids[keep].unsqueeze(0)
    positions = torch.cat([torch.arange(int(n)) for n in lengths]).unsqueeze(0)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return PackedRows(tokens, positions, lengths, cu_seqlens)


def unpack_rows(values: torch.Tensor, packed: PackedRows, seq_len: int) -> torch.Tensor:
    """Inverse of `pack_rows` for per-token values: (1, T, ...) -> (n, seq_len, ...), zero-padded."""
    out = values.new_zeros((len(packed.lengths), seq_len, *values.shape[2:]))
    for row, (start, end) in enumerate(zip(packed.cu_seqlens[:-1], packed.cu_seqlens[1:])):
        out[row, : end - start] = values[0, start:end]
    return out


def block_causal_mask(lengths: torch.Tensor) -> torch.Tensor:
    """(1, 1, T, T) bool mask for Megatron's local attention: True = may NOT attend.

    Token i may attend token j iff both are in the same row and j <= i.
    """
    row_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    same_row = row_of.unsqueeze(0) == row_of.unsqueeze(1)
    total = int(lengths.sum())
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return ~(same_row & causal).unsqueeze(0).unsqueeze(0)


def split_by_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group row indices into micro-batches whose total length stays within `max_tokens`.

    First-fit decreasing: few micro-batches, each close to the budget. Rows keep their original
    order inside a micro-batch; micro-batches are ordered by their first row.
    """
    if max_tokens < 1:
        raise ConfigError(f"max_tokens_per_micro_batch={max_tokens} must be positive")
    too_long = [n for n in lengths if n > max_tokens]
    if too_long:
        raise ConfigError(
            f"a sequence of {max(too_long)} tokens exceeds max_tokens_per_micro_batch={max_tokens}"
        )
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[index] <= free:
                bins[b].append(index)
                room[b] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(max_tokens - lengths[index])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])
