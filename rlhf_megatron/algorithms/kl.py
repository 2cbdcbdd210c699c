"""KL divergence to the reference policy: estimators, reward penalty, loss term, controllers.

Per-token estimators of KL(pi || pi_ref) from sampled tokens (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html), with ``d = logprob - ref_logprob``:
  * ``kl`` / ``k1``:          d                      (unbiased, high variance, can be negative)
  * ``abs``:                  |d|
  * ``mse`` / ``k2``:         0.5 * d^2
  * ``low_var_kl`` / ``k3``:  exp(-d) - 1 + d        (unbiased, low variance, >= 0)
verl conventions for k3: ``-d`` is clamped to [-20, 20] before ``exp`` and the estimate to
[-10, 10] (so the gradient is 0 outside those ranges).

Straight-through kinds (verl >= 0.5 names): ``kl+``/``k1+``, ``abs+``, ``low_var_kl+``/``k3+``
have the *value* of the base kind and the *gradient* of k2 (``k2 + sg[kind - k2]``), i.e.
``d(logprob - ref_logprob)`` per token, an unbiased gradient of KL(pi || pi_ref) on on-policy
samples whatever the reported estimate. ``mse+``/``k2+`` are plain k2.

KL is used either as a reward penalty (:func:`apply_kl_penalty`: ``rewards = scores - beta * kl``,
InstructGPT / Ziegler et al. 2019, verl ``apply_kl_penalty``) or as a loss term
(:func:`compute_kl_loss`, GRPO style). ``beta`` comes from a :class:`FixedKLController` or an
:class:`AdaptiveKLController` (Ziegler et al. 2019, arXiv:1909.08593).

Mask convention: ``response_mask`` ``(bs, T)``, 1 = real response token, 0 = padding; padding
positions are ignored (may hold NaN) and outputs are 0 there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_megatron.algorithms._checks import check_positive, validated_mask, zero_padding
from rlhf_megatron.algorithms.aggregation import LossAggregation
from rlhf_megatron.algorithms.errors import MissingInputError
from rlhf_megatron.algorithms.registry import Registry
from rlhf_megatron.algorithms.stats import _mean

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")

K3_EXP_CLAMP = 20.0  # verl: clamp log-ratio before exp
K3_OUT_CLAMP = 10.0  # verl: clamp the k3 estimate


@KL_ESTIMATORS.register("kl", "k1")
def _k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def _abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


@KL_ESTIMATORS.register("mse", "k2")
def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(ref_logprob - logprob, min=-K3_EXP_CLAMP, max=K3_EXP_CLAMP)
    return torch.clamp(log_ratio.exp() - log_ratio - 1, min=-K3_OUT_CLAMP, max=K3_OUT_CLAMP)


def _straight_through(kind: KLFn) -> KLFn:
    """Value of ``kind``, gradient of k2: ``k2 + sg[kind - k2]``."""

    def fn(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        k2 = _k2(logprob, ref_logprob)
        return k2 + (kind(logprob, ref_logprob) - k2).detach()

    fn.__qualname__ = f"straight_through({kind.__name__})"
    return fn


KL_ESTIMATORS.register("kl+", "k1+")(_straight_through(_k1))
KL_ESTIMATORS.register("abs+")(_straight_through(_abs))
KL_ESTIMATORS.register("low_var_kl+", "k3+")(_straight_through(_k3))
KL_ESTIMATORS.register("mse+", "k2+")(_k2)


def compute_kl(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, response_mask: torch.Tensor, kind: str = "kl"
) -> torch.Tensor:
    """Per-token KL estimate of kind ``kind`` (see module docstring; Schulman 2020).

    Args:
        logprob: ``(bs, T)`` log-probs of the sampled tokens under the policy (may require grad).
        ref_logprob: ``(bs, T)`` the same under the reference policy.
        response_mask: ``(bs, T)``; 1 = real response token, 0 = padding.
        kind: ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``, or a
            straight-through ``<kind>+`` (value of the kind, gradient of k2).

    Returns:
        ``(bs, T)``, 0 at padding positions.
    """
    fn = KL_ESTIMATORS.get(kind)
    mask = validated_mask(response_mask, logprob=logprob, ref_logprob=ref_logprob)
    return _kl_validated(fn, logprob, ref_logprob, mask)


def _kl_validated(
    fn: KLFn, logprob: torch.Tensor, ref_logprob: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    return zero_padding(fn(zero_padding(logprob, mask), zero_padding(ref_logprob, mask)), mask)


@dataclass(frozen=True)
class KLPenalty:
    """Result of :func:`apply_kl_penalty`.

    Attributes:
        token_level_rewards: ``(bs, T)`` ``scores - kl_coef * kl``, 0 at padding.
        kl: ``(bs, T)`` the per-token KL estimate, 0 at padding.
        current_kl: batch KL for the controller: the mean over sequences of each sequence's
            token-mean KL (an empty sequence counts as 0, as in verl).
    """

    token_level_rewards: torch.Tensor
    kl: torch.Tensor
    current_kl: float


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> KLPenalty:
    """KL as a reward penalty: ``token_level_rewards = token_level_scores - kl_coef * kl``.

    InstructGPT-style per-token penalty (Ouyang et al. 2022; Ziegler et al. 2019) as in verl's
    ``apply_kl_penalty``. Feed ``current_kl`` and the batch size to ``controller.update``.

    Args:
        token_level_scores: ``(bs, T)`` rewards before the penalty.
        logprob: ``(bs, T)`` rollout-policy ("old") log-probs of the sampled tokens.
        ref_logprob: ``(bs, T)`` reference-policy log-probs.
        response_mask: ``(bs, T)``; 1 = real response token, 0 = padding.
        kl_coef: beta, e.g. ``controller.value``.
        kind: KL estimator name (``kl`` is verl's default for the reward penalty).
    """
    check_positive("kl_coef", kl_coef, allow_zero=True)
    fn = KL_ESTIMATORS.get(kind)
    mask = validated_mask(
        response_mask,
        token_level_scores=token_level_scores,
        logprob=logprob,
        ref_logprob=ref_logprob,
    )
    kl = _kl_validated(fn, logprob, ref_logprob, mask)
    rewards = zero_padding(token_level_scores, mask) - kl_coef * kl
    current_kl = float(_mean(kl, mask, dim=-1).mean().item()) if kl.shape[0] else 0.0
    return KLPenalty(token_level_rewards=rewards, kl=kl, current_kl=current_kl)


def compute_kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    aggregation: LossAggregation | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a loss term (GRPO, Shao et al. 2024): ``aggregate(kl(logprob, ref_logprob))``.

    The caller multiplies by its coefficient (verl ``kl_loss_coef``; verl's default kind for the
    loss is ``low_var_kl``).

    Args:
        logprob: ``(bs, T)`` current-policy log-probs (requires grad).
        ref_logprob: ``(bs, T)`` reference log-probs.
        response_mask: ``(bs, T)``; 1 = real response token, 0 = padding.
        kind: KL estimator name.
        aggregation: how to reduce to a scalar (default: token-mean over this batch).

    Returns:
        ``(loss, metrics)``: 0-dim loss; metrics are 0-dim detached tensors: ``kl_mean`` (this
        micro-batch's token-mean KL).
    """
    fn = KL_ESTIMATORS.get(kind)
    agg = aggregation or LossAggregation()
    mask = validated_mask(response_mask, logprob=logprob, ref_logprob=ref_logprob)
    kl = _kl_validated(fn, logprob, ref_logprob, mask)
    loss = agg.apply_validated(kl, mask)
    return loss, {"kl_mean": _mean(kl.detach(), mask)}


class KLController(Protocol):
    """The coefficient beta of the KL reward penalty, updated once per step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """Constant beta (verl ``kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float) -> None:
        check_positive("kl_coef", kl_coef, allow_zero=True)
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


class AdaptiveKLController:
    """Adaptive beta (Ziegler et al. 2019, arXiv:1909.08593; verl ``AdaptiveKLController``).

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``beta *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        check_positive("kl_coef", init_kl_coef, allow_zero=True)
        check_positive("target_kl", target_kl)
        check_positive("horizon", horizon)
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta toward the target; ``n_steps`` is the batch size (verl)."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLControllerBuilder = Callable[[float, "float | None", "int | None"], KLController]

KL_CONTROLLERS: Registry[KLControllerBuilder] = Registry("KL controller")


@KL_CONTROLLERS.register("fixed")
def _build_fixed(kl_coef: float, target_kl: float | None, horizon: int | None) -> KLController:
    return FixedKLController(kl_coef)


@KL_CONTROLLERS.register("adaptive")
def _build_adaptive(kl_coef: float, target_kl: float | None, horizon: int | None) -> KLController:
    if target_kl is None or horizon is None:
        raise MissingInputError("the adaptive KL controller needs target_kl and horizon")
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> KLController:
    """Build the controller registered as ``kind`` (``fixed`` | ``adaptive``).

    ``fixed`` ignores ``target_kl`` and ``horizon``; ``adaptive`` requires both.
    """
    return KL_CONTROLLERS.get(kind)(kl_coef, target_kl, horizon)
