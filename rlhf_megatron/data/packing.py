"""Sequence packing (padding removal) and dynamic micro-batching by a token budget.

Packing concatenates the real tokens of several rows into one row of length T. Attention must not
cross row boundaries: on CPU (local attention) that is a block-diagonal causal mask; on GPU with
TE the same boundaries go to THD attention as cu_seqlens. RoPE is relative (a q.k score depends
only on the distance of the two positions), so positions need not restart per row for exactness,
but `position_ids` restart anyway for clarity and for absolute-position consumers.

Context parallelism (CP) splits each sequence into 2*cp equal chunks; CP rank r holds chunk r and
chunk 2*cp-1-r (one early, one late: causal attention work is balanced). Every sequence (a dense
row, or each packed row) is first padded at its end to a multiple of 2*cp (`pad_to`); causal
attention never lets a real token see the padding after it. `cp_token_indices` is the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf_megatron.errors import ConfigError


@dataclass(frozen=True)
class PackedRows:
    """Rows packed into one sequence.

    tokens: (1, T) int64, the real tokens of every row back to back (T = sum of lengths).
    position_ids: (1, T), restarting at 0 for each row.
    lengths: (n,) real length of each row; cu_seqlens: (n + 1,) int32 offsets, cu_seqlens[0] = 0.
    padded_lengths / cu_seqlens_padded: the same with each row padded to a multiple of `pad_to`
        (equal to lengths / cu_seqlens when pad_to = 1); row i occupies
        tokens[0, cu_seqlens_padded[i]:cu_seqlens_padded[i + 1]], real tokens first, then pad 0s.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    padded_lengths: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.padded_lengths is None:
            object.__setattr__(self, "padded_lengths", self.lengths)
            object.__setattr__(self, "cu_seqlens_padded", self.cu_seqlens)

    @property
    def total(self) -> int:
        return int(self.tokens.shape[1])


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return cu_seqlens


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, pad_to: int = 1) -> PackedRows:
    """Pack right-padded rows (bs, S) into one (1, T) row of real tokens, each row padded with
    token 0 to a multiple of `pad_to` (2*cp under context parallelism; 1 = no padding)."""
    lengths = attention_mask.sum(-1).long()
    padded = torch.tensor([round_up(int(n), pad_to) for n in lengths], dtype=torch.long)
    keep = attention_mask.bool()
    if pad_to == 1:
        tokens = input_ids[keep].unsqueeze(0)
    else:
        pieces = []
        for row, (n, p) in enumerate(zip(lengths.tolist(), padded.tolist())):
            pieces += [input_ids[row, keep[row]], input_ids.new_zeros(p - n)]
        tokens = torch.cat(pieces).unsqueeze(0)
    positions = torch.cat([torch.arange(int(n)) for n in padded]).unsqueeze(0)
    if pad_to == 1:
        return PackedRows(tokens, positions, lengths, _offsets(lengths))
    return PackedRows(tokens, positions, lengths, _offsets(lengths), padded, _offsets(padded))


def unpack_rows(values: torch.Tensor, packed: PackedRows, seq_len: int) -> torch.Tensor:
    """Inverse of `pack_rows` for per-token values: (1, T, ...) -> (n, seq_len, ...), zero-padded."""
    out = values.new_zeros((len(packed.lengths), seq_len, *values.shape[2:]))
    for row, (start, n) in enumerate(zip(packed.cu_seqlens_padded[:-1].tolist(),
                                         packed.lengths.tolist())):
        out[row, :n] = values[0, start:start + n]
    return out


def cp_token_indices(lengths: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """The positions CP rank `rank` holds of sequences laid back to back (int64, (sum(lengths)/cp,)).

    Each length must be a multiple of 2*cp. For each sequence (in order) the rank holds chunk
    `rank`, then chunk `2*cp - 1 - rank`, of its 2*cp equal chunks. Example: one sequence of 8,
    cp=2: rank 0 holds [0, 1, 6, 7], rank 1 holds [2, 3, 4, 5].
    """
    pieces, start = [], 0
    for length in lengths:
        assert length % (2 * cp) == 0, f"length {length} is not a multiple of 2*cp={2 * cp}"
        chunk = length // (2 * cp)
        for index in (rank, 2 * cp - 1 - rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += length
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


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
