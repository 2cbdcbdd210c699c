"""Rollout correction: importance weights and rejection masks for the rollout/trainer mismatch.

The tokens were sampled by the inference engine (the *behaviour* policy, its log-probs
``rollout_logprob``, e.g. vLLM's own), but the loss is written for the trainer's policy (the
*target*, PPO's ``old_logprob`` recomputed by the trainer). Kernels, precision and, with
asynchronous rollout, stale weights make the two differ. With the per-token log-ratio
``d_t = target_t - rollout_t`` and ``rho_t = exp(d_t)`` this module computes, per micro-batch,
*before* the forward pass (nothing here depends on the current policy, so every output is
detached):

  * **IS weights** (``is_level``), multiplied into every token's policy loss:
      - ``token``:    ``w_t = rho_t``
      - ``sequence``: ``w_i = prod_t rho_t = exp(sum_t d_t)``, broadcast to the sequence's tokens
    The log-weight is clamped to [-20, 20] before ``exp`` (verl's safety bound). Then
      - ``is_mode: truncate`` (TIS, Yao et al. 2025): ``w <- min(w, is_cap)``;
      - ``is_mode: mask`` (MIS, masked IS, Liu, Li et al. 2025): ``w`` is kept, and a token
        (token level) or a whole sequence (sequence level) with ``w > is_cap`` is *rejected*.
  * **icepop** (token masking, Ling team 2025, "IcePop"): tokens with ``rho_t`` outside
    ``[icepop_low, icepop_high]`` are rejected. With ``is_level: token`` and a cap at least
    ``icepop_high`` this is the paper's objective ``M(rho) * loss`` with ``M(k) = k`` in range.
  * **geometric-mean rejection**: a sequence whose ``exp(mean_t d_t)`` lies outside
    ``[geo_low, geo_high]`` is rejected (verl ``rollout_rs: geometric``; ``geo_low`` defaults to
    ``1 / geo_high``).

A rejected token leaves the loss mask: it adds nothing to any numerator *and* nothing to the
global normaliser (the engine counts the corrected mask), as verl's ``modified_response_mask``.
Every loss term of the update (policy, entropy, KL) uses the corrected mask.

Semantics follow verl's rollout correction (``verl/trainer/ppo/rollout_corr_helper.py``,
``docs/algo/rollout_corr.md``, Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL
Collapse from the Training-Inference Mismatch"); the code is our own.

Mask convention: ``response_mask`` ``(bs, T)``, 1 = real response token, 0 = padding. Metrics
are 0-dim detached tensors, plain means over *this* micro-batch (see :class:`RolloutCorrection`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_megatron.algorithms._checks import check_positive, validated_mask, zero_padding
from rlhf_megatron.algorithms.errors import InvalidConfigError
from rlhf_megatron.algorithms.stats import _mean

SAFETY_BOUND = 20.0  # verl: log-weights are clamped to [-20, 20] before exp
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
METRIC_PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``: everything off by default.

    Attributes:
        is_level: ``None`` (no IS weight), ``"token"`` or ``"sequence"``.
        is_mode: ``"truncate"`` (TIS: ``min(w, is_cap)``) or ``"mask"`` (MIS: reject
            ``w > is_cap``).
        is_cap: the cap C (> 0); typical 2 for tokens, 2-10 for sequences.
        icepop_low / icepop_high: icepop token masking range; both set or both None, 0 < low < high.
        geo_high: upper bound of the geometric-mean ratio (> 1); None turns the rejection off.
        geo_low: lower bound (0 < low < 1); None means ``1 / geo_high``.
    """

    is_level: str | None = None
    is_mode: str = "truncate"
    is_cap: float = 2.0
    icepop_low: float | None = None
    icepop_high: float | None = None
    geo_high: float | None = None
    geo_low: float | None = None

    def __post_init__(self) -> None:
        if self.is_level is not None and self.is_level not in IS_LEVELS:
            raise InvalidConfigError(
                f"is_level={self.is_level!r}: expected null, {' or '.join(IS_LEVELS)}"
            )
        if self.is_mode not in IS_MODES:
            raise InvalidConfigError(f"is_mode={self.is_mode!r}: expected {' or '.join(IS_MODES)}")
        check_positive("is_cap", self.is_cap)
        if (self.icepop_low is None) != (self.icepop_high is None):
            raise InvalidConfigError("icepop_low and icepop_high must be set together")
        if self.icepop_low is not None:
            check_positive("icepop_low", self.icepop_low)
            check_positive("icepop_high", self.icepop_high)
            if not self.icepop_low < self.icepop_high:
                raise InvalidConfigError(
                    f"icepop_low={self.icepop_low} must be < icepop_high={self.icepop_high}"
                )
        if self.geo_high is not None:
            check_positive("geo_high", self.geo_high)
            if not 1.0 < self.geo_high < float("inf"):
                raise InvalidConfigError(f"geo_high={self.geo_high} must be > 1")
        if self.geo_low is not None:
            if self.geo_high is None:
                raise InvalidConfigError("geo_low is set but geo_high is not")
            if not 0.0 < self.geo_low < 1.0:
                raise InvalidConfigError(f"geo_low={self.geo_low} must be in (0, 1)")

    @property
    def enabled(self) -> bool:
        """True when any correction (IS weight or rejection) is on."""
        return (
            self.is_level is not None or self.icepop_low is not None or self.geo_high is not None
        )

    @property
    def geo_bounds(self) -> tuple[float, float] | None:
        if self.geo_high is None:
            return None
        low = self.geo_low if self.geo_low is not None else 1.0 / self.geo_high
        return low, self.geo_high


@dataclass(frozen=True)
class RolloutCorrection:
    """Result of :func:`compute_rollout_correction`.

    Attributes:
        weights: ``(bs, T)`` detached IS weight per token (1 where ``is_level`` is None), 0 at
            padding and at rejected tokens.
        mask: ``(bs, T)`` bool, the response mask minus every rejected token.
        metrics: 0-dim detached tensors, keys prefixed ``rollout_corr/``:
            ``is_weight_mean`` (mean applied weight over kept tokens), ``is_weight_max`` (largest
            weight before truncation, over real tokens), ``is_truncated_frac`` (real tokens whose
            weight hit the cap; truncate mode), ``mis_masked_frac``, ``icepop_masked_frac``
            (fractions of real tokens rejected by each), ``geo_rejected_frac`` (fraction of
            non-empty sequences rejected), ``masked_frac`` (all rejected real tokens), and
            ``log_ratio_mean`` (mean of ``target - rollout``).
    """

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """Untruncated IS weights ``(bs, T)`` from a sanitised log-ratio and a bool mask.

    ``token``: ``exp(clamp(d_t))``; ``sequence``: ``exp(clamp(sum_t d_t))`` broadcast over the
    row. Clamp bounds +-20 (verl). 0 at padding. Shared by the policy losses' ``tis_cap``.
    """
    if level == "token":
        log_w = log_ratio
    elif level == "sequence":
        log_w = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    else:
        raise InvalidConfigError(f"is_level={level!r}: expected {' or '.join(IS_LEVELS)}")
    return zero_padding(torch.clamp(log_w, -SAFETY_BOUND, SAFETY_BOUND).exp(), mask)


def truncated_is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, cap: float
) -> torch.Tensor:
    """TIS: ``min(is_weights(...), cap)``, ``(bs, T)``, 0 at padding."""
    return torch.clamp(is_weights(log_ratio, mask, level), max=cap)


@torch.no_grad()
def compute_rollout_correction(
    target_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> RolloutCorrection:
    """IS weights, rejection mask and metrics for one micro-batch (see the module docstring).

    Args:
        target_logprob: ``(bs, T)`` the trainer's log-probs of the sampled tokens (``old``).
        rollout_logprob: ``(bs, T)`` the inference engine's log-probs of the same tokens.
        response_mask: ``(bs, T)``; 1 = real response token, 0 = padding.
        config: which corrections are on.

    Returns:
        :class:`RolloutCorrection` (weights, corrected bool mask, metrics), all detached.
    """
    mask = validated_mask(
        response_mask, target_logprob=target_logprob, rollout_logprob=rollout_logprob
    )
    d = zero_padding(target_logprob.detach() - rollout_logprob.detach(), mask)
    dtype = d.dtype
    keep = mask.clone()
    weights = mask.to(dtype)
    metrics: dict[str, torch.Tensor] = {"log_ratio_mean": _mean(d, mask)}
    zero = torch.zeros((), dtype=dtype, device=d.device)
    if config.is_level is not None:
        raw = is_weights(d, mask, config.is_level)
        metrics["is_weight_max"] = torch.where(mask, raw, zero).amax() if raw.numel() else zero
        over = (raw > config.is_cap) & mask
        if config.is_mode == "truncate":
            weights = torch.clamp(raw, max=config.is_cap)
            metrics["is_truncated_frac"] = _mean(over.to(dtype), mask)
        else:  # MIS: the weight is kept, the token (or sequence, all its tokens) is rejected
            weights = raw
            keep &= ~over
            metrics["mis_masked_frac"] = _mean(over.to(dtype), mask)
    if config.icepop_low is not None:
        rho = torch.clamp(d, -SAFETY_BOUND, SAFETY_BOUND).exp()
        out = ((rho < config.icepop_low) | (rho > config.icepop_high)) & mask
        keep &= ~out
        metrics["icepop_masked_frac"] = _mean(out.to(dtype), mask)
    bounds = config.geo_bounds
    if bounds is not None:
        rows = mask.any(dim=-1)
        n = mask.sum(dim=-1).clamp(min=1).to(dtype)
        geo = torch.clamp(d.sum(dim=-1) / n, -SAFETY_BOUND, SAFETY_BOUND).exp()
        rejected = ((geo < bounds[0]) | (geo > bounds[1])) & rows
        keep &= ~rejected.unsqueeze(-1)
        metrics["geo_rejected_frac"] = _mean(rejected.to(dtype), rows)
    weights = zero_padding(weights, keep)
    metrics["is_weight_mean"] = torch.where(keep.any(), _mean(weights, keep), zero + 1)
    metrics["masked_frac"] = _mean((mask & ~keep).to(dtype), mask)
    metrics = {METRIC_PREFIX + k: v.detach() for k, v in metrics.items()}
    return RolloutCorrection(weights=weights, mask=keep, metrics=metrics)
