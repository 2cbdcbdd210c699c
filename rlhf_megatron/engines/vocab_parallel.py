"""Log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice [start, start + V_local) of the padded vocabulary. The
softmax normaliser, the target logit and the entropy's expectation term are sums over the
vocabulary, so each rank sums its slice and one all-reduce finishes them. The all-reduce is
Megatron's `reduce_from_tensor_model_parallel_region` (identity in backward), which gives the
exact gradient of a sum of per-shard terms as long as each per-shard term depends on this rank's
logits only: everything built from reduced values (Z, A) is replicated on all ranks. Padded vocabulary columns (ids >= the real vocab size)
are excluded from the softmax so the result equals HF's on the unpadded vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and the entropy of each position's distribution.

    logits: (..., V_local) this TP rank's slice of the padded vocabulary (any float dtype;
        computed in fp32).
    targets: (...) int64 global token ids (< vocab_size).
    vocab_size: the real (unpadded) vocabulary size.
    Returns logprobs (...) and entropy (...) (or None), both fp32 and identical on all TP ranks.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab
    # Padded columns sit at the end of the vocabulary: slicing them off (a view) is cheaper than
    # masking a copy of the logits. A rank whose slice is all padding keeps one masked column.
    all_padding = start >= vocab_size
    keep = 1 if all_padding else min(local_vocab, vocab_size - start)
    logits = logits[..., :keep].float()
    if all_padding:
        logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool), float("-inf"))

    # The max only stabilises exp(); the result does not depend on it, so it needs no gradient.
    global_max = logits.detach().max(dim=-1).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(
            global_max, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
    shifted = logits - global_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_normaliser = sum_exp.log()

    in_slice = (targets >= start) & (targets < start + keep)
    local_index = (targets - start).clamp(0, keep - 1)
    target_logit = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tensor_model_parallel_region(
        torch.where(in_slice, target_logit, torch.zeros_like(target_logit))
    )
    logprobs = target_logit - log_normaliser
    if not compute_entropy:
        return logprobs, None
    # H = log Z - E_p[shifted logit] = log Z - A / Z with A = sum_v exp(s_v) * s_v; a masked
    # padding column has exp = 0 and a -inf logit, so it is zeroed. A is reduced before it is
    # divided by Z: dividing each rank's slice by Z first would make Z feed per-rank terms, and
    # the identity backward of the reduce would then miss the other ranks' share of dH/dZ (wrong
    # gradient at TP > 1, right value).
    if all_padding:
        shifted = shifted.masked_fill(shifted.isinf(), 0.0)
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    entropy = log_normaliser - weighted / sum_exp
    return logprobs, entropy


def next_token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    vocab_size: int,
    compute_entropy: bool = True,
    cp: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) and the entropy at t, for t < T - 1.

    logits: (b, T_local, V_local) of this rank's positions: all T of them without context
        parallelism; with it (cp: engines/context_parallel.CpSplit) this CP rank's T / cp.
    tokens: (b, T) int64, the whole sequence (padded, packed: as the model saw it).
    Returns (b, T - 1) fp32 values in sequence order, on every CP and TP rank. Under CP each rank
    scores its own positions against their global next tokens and the values are all-gathered;
    the backward keeps each rank's own positions' gradient (see engines/context_parallel.py).
    """
    if cp is None:
        return vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size=vocab_size,
                                       compute_entropy=compute_entropy)
    logprobs, entropy = vocab_parallel_logprobs(
        logits, cp.next_tokens(tokens), vocab_size=vocab_size, compute_entropy=compute_entropy
    )
    logprobs = cp.gather(logprobs)[:, :-1]
    entropy = None if entropy is None else cp.gather(entropy)[:, :-1]
    return logprobs, entropy
