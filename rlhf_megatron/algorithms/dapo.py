"""DAPO's two data-side techniques, in pure torch (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv:2503.14476; verl ``recipe/dapo``).

  * **Dynamic sampling**: a group (the responses to one prompt) whose rewards are all equal has
    advantage 0 under group-relative estimators and adds no gradient, only noise in the batch
    size. Such groups are dropped and generation continues until the batch holds the configured
    number of groups (:func:`informative_groups` decides; ``controller/dynamic_sampling.py``
    runs the rounds). Filtering reads the raw task scores, before overlong shaping (verl filters
    on ``acc``/``score``, not on the shaped reward).
  * **Overlong reward shaping** (soft overlong punishment): with ``L_max`` the maximum response
    length and a buffer of ``L`` tokens, a response of ``n`` tokens gets
    ``penalty * clip((n - (L_max - L)) / L, 0, 1)`` subtracted from its score: 0 up to
    ``L_max - L`` tokens, rising linearly to ``penalty`` at ``L_max`` (:func:`overlong_penalty`).

Shapes: ``(bs,)`` per response. Configs validate on construction with one-line errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_megatron.algorithms._checks import check_positive
from rlhf_megatron.algorithms.errors import InvalidConfigError, ShapeMismatchError


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """``algorithm.dynamic_sampling``.

    Attributes:
        enabled: drop groups whose rewards are all equal and keep generating (off by default).
        max_rounds: generation rounds per step at most (>= 1), each of ``data.prompts_per_step``
            new prompts. When the rounds run out before the batch is full, it is topped up with
            dropped groups (advantage 0), so the batch size stays fixed; the step logs how many.
    """

    enabled: bool = False
    max_rounds: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.max_rounds, bool) or int(self.max_rounds) != self.max_rounds \
                or self.max_rounds < 1:
            raise InvalidConfigError(f"max_rounds={self.max_rounds!r} must be an integer >= 1")


@dataclass(frozen=True)
class OverlongShapingConfig:
    """``algorithm.overlong_shaping`` (verl ``reward_model.overlong_buffer``).

    Attributes:
        buffer: L, the soft-penalty zone in tokens before the maximum length; 0 turns it off.
        penalty: the penalty at the maximum length (verl ``penalty_factor``; DAPO uses 1).
        max_length: L_max; None means ``rollout.sampling.max_tokens``.
    """

    buffer: int = 0
    penalty: float = 1.0
    max_length: int | None = None

    def __post_init__(self) -> None:
        if self.buffer < 0:
            raise InvalidConfigError(f"buffer={self.buffer} must be >= 0 (0 turns it off)")
        check_positive("penalty", self.penalty, allow_zero=True)
        if self.max_length is not None and self.max_length < 1:
            raise InvalidConfigError(f"max_length={self.max_length} must be >= 1")
        if self.max_length is not None and self.buffer > self.max_length:
            raise InvalidConfigError(
                f"buffer={self.buffer} must not exceed max_length={self.max_length}"
            )

    @property
    def enabled(self) -> bool:
        return self.buffer > 0


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, ``(bs,)``, >= 0: subtract it from the scores.

    ``penalty * clip((n - (max_length - buffer)) / buffer, 0, 1)`` for a response of ``n``
    tokens. Example: max 20, buffer 4, penalty 1: n = 16 -> 0, 18 -> 0.5, 20 -> 1.
    """
    if buffer < 1 or buffer > max_length:
        raise InvalidConfigError(f"buffer={buffer} must be in [1, max_length={max_length}]")
    exceed = lengths.to(torch.float64) - (max_length - buffer)
    return (penalty * (exceed / buffer).clamp(0.0, 1.0)).float()


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``(bs,)`` bool: True for the responses of groups whose scores are not all equal.

    A group of one response is kept (verl keeps it: its advantage is its raw score under the
    group estimators). Equality is exact, as rewards of a verifier are.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ShapeMismatchError(
            f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must be (bs,)"
        )
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    hi = scores.new_full((len(counts),), float("-inf")).scatter_reduce(0, inverse, scores, "amax")
    lo = scores.new_full((len(counts),), float("inf")).scatter_reduce(0, inverse, scores, "amin")
    return ((hi != lo) | (counts == 1))[inverse]


def shape_overlong(
    scores: torch.Tensor, lengths: torch.Tensor, config: OverlongShapingConfig, max_tokens: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """``scores - overlong_penalty`` (``(bs,)``) and its metrics; unchanged when ``buffer`` is 0.

    ``max_tokens`` is used when ``config.max_length`` is None. Metrics: ``reward/overlong_penalty``
    (mean penalty) and ``reward/overlong_frac`` (share of responses penalised).
    """
    if not config.enabled:
        return scores, {}
    max_length = config.max_length if config.max_length is not None else max_tokens
    penalty = overlong_penalty(lengths, max_length, config.buffer, config.penalty)
    penalty = penalty.to(scores.dtype)
    return scores - penalty, {
        "reward/overlong_penalty": float(penalty.mean()) if len(penalty) else 0.0,
        "reward/overlong_frac": float((penalty > 0).float().mean()) if len(penalty) else 0.0,
    }
