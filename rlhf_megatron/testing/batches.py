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


def next_token_pass(chunks: list, micro_batches: list[torch.Tensor], vocab_size: int, *,
                    forward_only: bool) -> list[torch.Tensor]:
    """One pass of Megatron's pipeline schedule through the model `chunks` over `micro_batches`
    (rows from random_token_rows) with next_token_nll as the loss, its gradients left in the
    chunks unless `forward_only`; the parity tests' step. Returns each micro-batch's logits as
    the last pipeline stage saw them, gathered over TP and cut to `vocab_size` (none on other
    stages). With several chunks (virtual pipeline stages) each walks every micro-batch."""
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows, seq_len = micro_batches[0].shape[0], micro_batches[0].shape[1] - 1
    seen: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        tokens, targets = micro[:, :-1], micro[:, 1:]
        output = model(tokens, torch.arange(seq_len).expand(tokens.shape[0], -1), None)

        def loss_func(logits):
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            seen.append(full.detach()[..., :vocab_size])
            return next_token_nll(full, targets, vocab_size), {}

        return output, loss_func

    iterators = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators, model=chunks,
        num_microbatches=len(micro_batches), seq_length=seq_len, micro_batch_size=rows,
        forward_only=forward_only)
    return seen
