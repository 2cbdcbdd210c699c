"""Batches of the engine tests (tests/integration/engines/: built in the test process, handed
to the ranks)."""

from __future__ import annotations

import torch

from rlhf_megatron.data.batch import TokenBatch

PROMPT_TOKENS = 5


def padded_prompt_batch(generator: torch.Generator, rows: int = 8, seq: int = 14) -> TokenBatch:
    """`rows` random rows of token ids in [3, 300), right-padded (id 0) to `seq` from a length
    drawn in [seq // 2, seq]; the loss mask covers each row's tokens after the first
    PROMPT_TOKENS (the prompt). Draws from `generator`, which goes on to fill other fields."""
    ids = torch.randint(3, 300, (rows, seq), generator=generator)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=generator)
    attn = (torch.arange(seq) < lengths[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, :PROMPT_TOKENS] = 0
    return TokenBatch(ids * attn, attn, loss_mask)
