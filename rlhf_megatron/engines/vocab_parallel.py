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

from rlhf_megatron.data.sampling import SampledDistribution


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    compute_entropy: bool = True,
    sampling: SampledDistribution | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and the entropy of each position's distribution.

    logits: (..., V_local) this TP rank's slice of the padded vocabulary (any float dtype;
        computed in fp32).
    targets: (...) int64 global token ids (< vocab_size).
    vocab_size: the real (unpadded) vocabulary size.
    sampling: per-position settings broadcastable to (...) (data/sampling.py): the logits are
        divided by the temperature and, where top-k/top-p truncate, restricted to the tokens
        they keep (the target always kept), so both values are of the sampled distribution.
        None: temperature 1, untruncated.
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
    masked = all_padding
    if sampling is not None:
        logits = logits / sampling.temperature.unsqueeze(-1).to(logits)
        if sampling.truncates(vocab_size):
            kept = sampled_support(logits.detach(), sampling, targets - start, vocab_size)
            logits = logits.masked_fill(~kept, float("-inf"))
            masked = True

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
    if masked:
        shifted = shifted.masked_fill(shifted.isinf(), 0.0)
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    entropy = log_normaliser - weighted / sum_exp
    return logprobs, entropy


def sampled_support(
    logits: torch.Tensor, sampling: SampledDistribution, local_targets: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """(..., V_local) bool: the tokens of this rank's slice that vLLM's top-k then top-p keep
    (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch), plus the target.

    logits: (..., V_local) tempered, real-vocabulary columns only (no gradient needed).
    top-k keeps the logits >= the k-th largest of the whole vocabulary: each rank's k largest,
    all-gathered, give it. top-p then masks a token when the probability mass of the tokens at
    or below its logit is <= 1 - p (the argmax is always kept). That mass is a sum over the
    vocabulary, so the cut logit is found by bisection on all-reduced sums: 48 halvings of the
    logit range (in fp64), below fp32's resolution. Ties at the cut are kept or masked together
    (vLLM's sort splits them arbitrarily). The target is kept in any case: a boundary token the
    sampler kept and the replay (by a rounding) would not must not get log-prob -inf.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    kept = torch.ones_like(logits, dtype=torch.bool)
    top_k = sampling.top_k.expand(logits.shape[:-1])
    k_on = (top_k > 0) & (top_k < vocab_size)
    if bool(k_on.any()):
        k_max = int(top_k[k_on].max())
        local = logits.topk(min(k_max, logits.shape[-1]), dim=-1).values
        local = torch.nn.functional.pad(local, (0, k_max - local.shape[-1]), value=float("-inf"))
        if tp > 1:
            pieces = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(pieces, local.contiguous(), group=group)
            local = torch.cat(pieces, dim=-1)
        top = local.topk(k_max, dim=-1).values
        kth = top.gather(-1, (top_k.clamp(1, k_max) - 1).unsqueeze(-1))
        kept &= ~k_on.unsqueeze(-1) | (logits >= kth)
    top_p = sampling.top_p.expand(logits.shape[:-1])
    p_on = top_p < 1
    if bool(p_on.any()):
        # fp32 like vLLM's sampler (no fp64 copy of the logits); the cut itself is bisected in
        # fp64 so that 48 halvings resolve it below fp32's spacing.
        z = logits.masked_fill(~kept, float("-inf"))
        peak = z.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        weights = (z - peak.unsqueeze(-1)).exp()  # unnormalised probabilities, 0 where masked
        total = _tp_sum(weights.sum(-1), group)
        tail = (1 - top_p) * total  # a token is masked when the mass at or below it <= tail
        finite = z.masked_fill(z.isinf(), float("inf")).min(dim=-1).values
        if tp > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=group)
        lo, hi = finite.double() - 1.0, peak.double()
        for _ in range(48):
            mid = (lo + hi) / 2
            below = _tp_sum((weights * (z <= mid.unsqueeze(-1))).sum(-1), group)
            low_enough = below <= tail
            lo, hi = torch.where(low_enough, mid, lo), torch.where(low_enough, hi, mid)
        kept &= ~p_on.unsqueeze(-1) | (z > lo.unsqueeze(-1))
    columns = torch.arange(logits.shape[-1], device=logits.device)
    return kept | (columns == local_targets.unsqueeze(-1))


def _tp_sum(value: torch.Tensor, group: Any) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(value, group=group)
    return value
