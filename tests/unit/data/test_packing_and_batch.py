"""TokenBatch container, sequence packing and token-budget micro-batching."""

import pytest
import torch

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.packing import (
    block_causal_mask,
    pack_rows,
    split_by_token_budget,
    unpack_rows,
)
from rlhf_megatron.errors import ConfigError


def _rows():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    attn = (ids != 0).long()
    attn[2] = 1
    return ids, attn


def test_pack_keeps_real_tokens_and_restarts_positions():
    ids, attn = _rows()
    packed = pack_rows(ids, attn)
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert packed.total == 9


def test_unpack_inverts_pack_and_zero_pads():
    ids, attn = _rows()
    packed = pack_rows(ids, attn)
    values = packed.tokens.float().unsqueeze(-1) * 10
    rows = unpack_rows(values, packed, 4)[..., 0]
    assert torch.equal(rows, ids.float() * 10 * attn)


def test_block_causal_mask_blocks_other_rows_and_the_future():
    mask = block_causal_mask(torch.tensor([2, 3]))[0, 0]
    allowed = ~mask
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_token_budget_groups_cover_every_row_once_within_budget():
    lengths = [7, 3, 9, 2, 5, 5, 1, 8]
    groups = split_by_token_budget(lengths, 10)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 10 for g in groups)
    assert len(groups) == 4  # 40 tokens in bins of 10: first-fit decreasing reaches the bound
    assert all(g == sorted(g) for g in groups)


def test_token_budget_rejects_a_row_longer_than_the_budget():
    with pytest.raises(ConfigError, match="a sequence of 12 tokens exceeds max_tokens_per_micro_batch=10"):
        split_by_token_budget([3, 12], 10)
    with pytest.raises(ConfigError, match="must be positive"):
        split_by_token_budget([3], 0)


def test_token_batch_validates_shapes():
    ids, attn = _rows()
    with pytest.raises(ConfigError, match="loss_mask has shape"):
        TokenBatch(ids, attn, attn[:, :2])
    with pytest.raises(ConfigError, match="field 'advantages' has 2 rows, the batch 3"):
        TokenBatch(ids, attn, attn, {"advantages": torch.zeros(2, 4)})
    with pytest.raises(ConfigError, match="must be \\(bs, S\\)"):
        TokenBatch(ids[0], attn[0], attn[0])


def test_token_batch_select_chunk_concat_round_trip():
    ids, attn = _rows()
    batch = TokenBatch(ids, attn, attn, {"adv": torch.arange(12.0).view(3, 4), "seq": torch.arange(3)})
    assert batch.lengths().tolist() == [3, 2, 4]
    picked = batch.select([2, 0])
    assert picked.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 0]]
    assert picked.fields["seq"].tolist() == [2, 0]
    with pytest.raises(ConfigError, match="cannot split a batch of 3 into 2 equal parts"):
        batch.chunk(2)
    narrow = TokenBatch(ids[:, :3], attn[:, :3], attn[:, :3], {"adv": torch.ones(3, 3), "seq": torch.arange(3)})
    joined = TokenBatch.concat([batch, narrow])
    assert joined.input_ids.shape == (6, 4) and joined.fields["adv"].shape == (6, 4)
    assert joined.attention_mask[3:, 3].sum() == 0  # padded, not real
    with pytest.raises(ConfigError, match="empty list"):
        TokenBatch.concat([])
