"""Clipped value-function loss for the PPO critic (verl ``compute_value_loss``).

Per token, with ``v`` the new prediction, ``v_old`` the rollout-time value and ``R`` the return:
``v_clip = clamp(v, v_old - c, v_old + c)``; ``L = 0.5 * max((v - R)^2, (v_clip - R)^2)``
(the pessimistic clipped objective of OpenAI baselines' PPO2, used by verl and TRL). The 0.5
factor multiplies the aggregated loss, as in verl.

Mask convention: ``response_mask`` ``(bs, T)``, 1 = real response token, 0 = padding; padding
positions are ignored (may hold NaN) and get an exact zero gradient.
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms._checks import check_positive, validated_mask, zero_padding
from rlhf_megatron.algorithms.aggregation import LossAggregation
from rlhf_megatron.algorithms.stats import _mean


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    aggregation: LossAggregation | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * aggregate(max((v - R)^2, (clip(v, v_old +- c) - R)^2))``.

    Args:
        vpreds: ``(bs, T)`` current critic predictions (requires grad).
        values: ``(bs, T)`` critic values at rollout time (the clipping centre).
        returns: ``(bs, T)`` targets (from the advantage estimator).
        response_mask: ``(bs, T)``; 1 = real response token, 0 = padding.
        cliprange_value: ``c`` > 0 (verl ``cliprange_value``, default 0.5).
        aggregation: mode and global normaliser (default: token-mean over this batch).

    Returns:
        ``(loss, metrics)``: 0-dim loss; metrics are 0-dim detached tensors over this
        micro-batch: ``vf_clipfrac`` (fraction of real tokens where the clipped term is larger),
        ``vpred_mean``.
    """
    check_positive("cliprange_value", cliprange_value)
    agg = aggregation or LossAggregation()
    mask = validated_mask(response_mask, vpreds=vpreds, values=values, returns=returns)
    v = zero_padding(vpreds, mask)
    v_old = zero_padding(values.detach(), mask)
    ret = zero_padding(returns.detach(), mask)
    v_clipped = torch.maximum(torch.minimum(v, v_old + cliprange_value), v_old - cliprange_value)
    loss_unclipped = (v - ret) ** 2
    loss_clipped = (v_clipped - ret) ** 2
    loss = 0.5 * agg.apply_validated(torch.maximum(loss_unclipped, loss_clipped), mask)
    metrics = {
        "vf_clipfrac": _mean((loss_clipped > loss_unclipped).to(v.dtype), mask).detach(),
        "vpred_mean": _mean(v.detach(), mask),
    }
    return loss, metrics
