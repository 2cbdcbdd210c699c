"""Masked statistics over response tokens (verl ``verl/utils/torch_functional.py`` semantics).

Mask convention everywhere: ``mask`` has the shape of ``values``; 1 = real response token,
0 = padding. Padding positions never influence a result (they may even hold NaN/inf); outputs that
have the input's shape are 0 at padding positions.

verl conventions followed (documented in docs/ALGORITHMS.md):
  * ``masked_mean`` of an empty mask is 0 (verl divides by ``count + 1e-8``; for ``count >= 1``
    that equals dividing by ``count`` in float32, which is what we do).
  * ``masked_var`` is unbiased by default (Bessel: ``* n / (n - 1)``) and raises on ``n == 0``, or
    on ``n == 1`` when unbiased, as verl does.
  * ``masked_whiten`` uses the unbiased variance and puts ``1e-8`` *inside* the root:
    ``(x - mean) * rsqrt(var + 1e-8)``; ``shift_mean=False`` adds the mean back.
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms._checks import validated_mask, zero_padding
from rlhf_megatron.algorithms.errors import InsufficientDataError

WHITEN_EPS = 1e-8  # inside rsqrt, as verl's masked_whiten


def _sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    clean = zero_padding(values, mask)
    return clean.sum() if dim is None else clean.sum(dim=dim)


def _mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return _sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def _var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    n = int(mask.sum().item())
    if n == 0:
        raise InsufficientDataError("masked variance needs at least one real (mask == 1) element")
    if unbiased and n == 1:
        raise InsufficientDataError(
            "unbiased masked variance needs at least two real elements; got one"
        )
    mean = _mean(values, mask)
    var = _mean((zero_padding(values, mask) - mean) ** 2, mask)
    return var * (n / (n - 1)) if unbiased else var


def _whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    mean = _mean(values, mask)
    var = _var(values, mask, unbiased=True)
    whitened = (zero_padding(values, mask) - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return zero_padding(whitened, mask)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over real positions.

    Args:
        values: any shape, e.g. ``(bs, T)``.
        mask: same shape; 1 = real response token, 0 = padding.
        dim: reduce only this dimension (``None``: all, giving a 0-dim tensor).
    """
    m = validated_mask(mask, token_dims=None, values=values)
    return _sum(values, m, dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over real positions; 0 where there is none (verl: ``sum / (n + 1e-8)``).

    Args:
        values: any shape, e.g. ``(bs, T)``.
        mask: same shape; 1 = real response token, 0 = padding.
        dim: reduce only this dimension (``None``: all, giving a 0-dim tensor).
    """
    m = validated_mask(mask, token_dims=None, values=values)
    return _mean(values, m, dim)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all real positions (0-dim tensor).

    ``unbiased=True`` (default, as verl) applies Bessel's correction ``n / (n - 1)``.

    Args:
        values: any shape, e.g. ``(bs, T)``.
        mask: same shape; 1 = real response token, 0 = padding.

    Raises:
        InsufficientDataError: no real element, or exactly one with ``unbiased=True``.
    """
    m = validated_mask(mask, token_dims=None, values=values)
    return _var(values, m, unbiased)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """Whiten ``values`` over all real positions: ``(x - mean) * rsqrt(var_unbiased + 1e-8)``.

    Used for batch-level advantage normalisation (PPO/GAE, REINFORCE++; Schulman et al. 2017
    practice, verl ``masked_whiten``). ``shift_mean=False`` adds the mean back (scale only).

    Args:
        values: any shape, e.g. ``(bs, T)``.
        mask: same shape; 1 = real response token, 0 = padding.

    Returns:
        Same shape as ``values``; 0 at padding positions.

    Raises:
        InsufficientDataError: fewer than two real elements.
    """
    m = validated_mask(mask, token_dims=None, values=values)
    return _whiten(values, m, shift_mean)
