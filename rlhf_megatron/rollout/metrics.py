"""Rollout-vs-trainer agreement, logged every step by the controller."""

from __future__ import annotations

import torch


def rollout_logprob_diff(
    rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Mean and max |rollout - trainer| log-prob of the same tokens.

    All (bs, S), aligned with input_ids; mask: 1 = a sampled (response) token.
    A large value means the rollout runs other weights than the trainer (a missed refit, a
    stale cache) or a numerics gap (e.g. bf16 rollout vs fp32 trainer).
    """
    diff = (rollout_logprobs.float() - trainer_logprobs.float()).abs() * mask
    count = mask.sum().clamp_min(1)
    return {
        "rollout/logprob_diff_mean": float(diff.sum() / count),
        "rollout/logprob_diff_max": float(diff.max()) if mask.any() else 0.0,
    }
