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


def random_token_rows(vocab_size: int, rows: int, seq_len: int, seed: int) -> torch.Tensor:
    """(rows, seq_len + 1) token ids in [3, vocab_size) (above the special ids 0-2): inputs are
    [:, :-1], next-token targets [:, 1:]. The parity tests' batch."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (rows, seq_len + 1), generator=generator)


def next_token_nll(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean negative log-likelihood of `targets` under `logits` (fp32, vocabulary padding cut
    off): the parity tests' loss, equal over any split into equal-size micro-batches and ranks."""
    logprobs = torch.log_softmax(logits[..., :vocab_size].float(), dim=-1)
    return -logprobs.gather(-1, targets.unsqueeze(-1)).mean()
