"""Named batch fields are views of `fields`: additive, so string-keyed code keeps working."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.data.batch import BATCH_FIELDS, TokenBatch


def _batch() -> TokenBatch:
    ids = torch.arange(6).view(2, 3)
    return TokenBatch(ids, torch.ones(2, 3), torch.ones(2, 3))


def test_named_field_reads_the_fields_entry_through_select_and_concat() -> None:
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, -4.0]])
    batch = _batch().with_fields(old_logprobs=old)
    assert batch.old_logprobs is batch.fields["old_logprobs"]
    assert torch.equal(batch.select([1]).old_logprobs, old[1:])
    assert torch.equal(TokenBatch.concat([batch, batch]).old_logprobs, torch.cat([old, old]))
    assert batch.ref_logprobs is None  # absent until a phase adds it


def test_every_documented_field_is_an_attribute_and_read_only() -> None:
    batch = _batch()
    for name in BATCH_FIELDS:
        assert getattr(batch, name) is None
    with pytest.raises(AttributeError, match="with_fields"):
        batch.advantages = torch.zeros(2, 3)
