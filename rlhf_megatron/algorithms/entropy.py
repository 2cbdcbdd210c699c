"""Entropy of the policy's next-token distribution, from logits.

``H = logsumexp(z) - sum_v softmax(z)_v * z_v``: the log-partition form avoids ``log(softmax)``,
whose tiny probabilities underflow (verl ``entropy_from_logits``); we also subtract the max logit
first (H is shift-invariant), which keeps the two terms small for large logits.
Aggregate it with :class:`~rlhf_megatron.algorithms.aggregation.LossAggregation` for an entropy
bonus (``loss = pg_loss - entropy_coeff * aggregate(entropy)``).
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.errors import NonFiniteInputError, ShapeMismatchError


def entropy_from_logits(logits: torch.Tensor, *, check_finite: bool = False) -> torch.Tensor:
    """Per-position entropy of ``softmax(logits)``.

    Args:
        logits: ``(bs, T, V)`` (any leading shape ``(..., V)``); the vocabulary is the last dim.
            Computed in the input dtype: upcast bf16 logits first if you need float32 accuracy.
        check_finite: raise ``NonFiniteInputError`` on NaN/inf logits (one host sync; off by
            default since the logits are the model's own output). There is no mask: every position
            gets a value; reduce with a mask (1 = real response token, 0 = padding) afterwards.

    Returns:
        ``(bs, T)`` (``logits.shape[:-1]``), in nats, differentiable.
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ShapeMismatchError(f"logits must be (..., V) with V >= 1, got {tuple(logits.shape)}")
    if check_finite and not bool(torch.isfinite(logits.detach()).all()):
        raise NonFiniteInputError("logits hold NaN or inf")
    # H is shift-invariant; subtracting the max keeps both terms small, so their difference
    # does not lose precision to cancellation for large logits.
    z = logits - logits.detach().amax(dim=-1, keepdim=True)
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)
