"""The CP split of sequences (data/packing.py): 2*cp chunks, rank r holds r and 2*cp-1-r; packed
rows padded to multiples of 2*cp and read back at their padded offsets."""

from __future__ import annotations

import torch

from rlhf_megatron.data.packing import cp_token_indices, pack_rows, unpack_rows
from rlhf_megatron.models.sdpa_cp import sequence_order


def test_each_rank_holds_an_early_and_a_late_chunk_of_every_sequence():
    assert cp_token_indices([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_token_indices([8], 2, 1).tolist() == [2, 3, 4, 5]
    # Two packed sequences of 4 and 8 tokens: per sequence, chunk r then chunk 3 - r.
    assert cp_token_indices([4, 8], 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    held = torch.cat([cp_token_indices([6, 12, 18], 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(36))  # every token once


def test_sequence_order_undoes_the_rank_major_concatenation():
    lengths = [4, 8, 12]
    held = torch.cat([cp_token_indices(lengths, 2, r) for r in range(2)])
    assert held[sequence_order(lengths, 2)].tolist() == list(range(24))


def test_pack_rows_pads_each_row_to_the_multiple_and_unpacks_at_padded_offsets():
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]])
    mask = (ids != 0).long()
    packed = pack_rows(ids, mask, pad_to=4)
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0, 1, 2, 3, 0]]
    assert packed.lengths.tolist() == [5, 3]
    assert packed.cu_seqlens.tolist() == [0, 5, 8]
    assert packed.cu_seqlens_padded.tolist() == [0, 8, 12]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    values = packed.tokens.float().unsqueeze(-1)
    assert unpack_rows(values, packed, 5).squeeze(-1).tolist() == ids.float().tolist()
    plain = pack_rows(ids, mask)  # pad_to=1: unchanged behaviour
    assert plain.tokens.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3]]
    assert plain.cu_seqlens_padded is plain.cu_seqlens


def test_tokens_per_cp_rank_counts_each_rank_share_of_a_mask():
    from rlhf_megatron.engines.context_parallel import tokens_per_cp_rank

    # Width 6 pads to 8 (2*cp = 4): rank 0 holds positions 0-1 and 6-7, rank 1 positions 2-5.
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]])
    assert tokens_per_cp_rank(mask, 2).tolist() == [[0, 0], [3, 2]]
    mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    assert tokens_per_cp_rank(mask, 2).tolist() == [[2], [2]]
