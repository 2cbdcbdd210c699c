"""Policy-gradient losses: one signature, one registry.

Every loss is ``fn(inputs: PolicyLossInputs, config: PolicyLossConfig, aggregation:
LossAggregation) -> (loss, metrics)``: ``loss`` is this micro-batch's 0-dim share of the global
loss (see ``aggregation.py``); ``metrics`` maps names to **0-dim detached tensors** (no host sync;
the caller ``.item()``s them when it logs). Metrics are plain token means over *this* micro-batch
(not globally normalised): ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (mean of
``old_logprob - logprob``), ``ratio_min``, ``ratio_max``, ``ratio_mean`` and, when a
``rollout_log_prob`` is given, ``rollout_kl`` (mean of ``old - rollout``) and ``tis_weight_mean``
(1.0 when TIS is off). An empty micro-batch reports fractions and KL 0 and ratios 1.

Mask convention: ``response_mask`` 1 = real response token, 0 = padding; padding positions are
ignored (may hold NaN) and get an exact zero gradient.

Registered losses (verl ``core_algos`` names):
  * ``vanilla``: PPO clip (Schulman et al. 2017) with separate low/high ranges (DAPO
    clip-higher, Yu et al. 2025, arXiv:2503.14476) and, for negative advantages, dual clip at
    ``clip_ratio_c`` (Ye et al. 2020, arXiv:1912.09729). The log-ratio is clamped to [-20, 20]
    before ``exp`` (verl).
  * ``gspo``: GSPO (Zheng et al. 2025, arXiv:2507.18071): sequence-level ratio
    ``s_i = exp(mean_t(logp - old))`` applied per token as ``sg[s_i] * pi / sg[pi]`` so each token
    carries the gradient ``s_i * grad logp_t``; log-ratio clamped at 10 (verl). Always aggregated
    with ``seq-mean-token-mean`` whatever ``aggregation.mode`` says (verl does the same); the
    normaliser and scale factor are kept.
Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings
you off-policy RL training"): with ``config.tis_cap`` set, each token's loss is multiplied by the
detached ``min(exp(old_logprob - rollout_logprob), tis_cap)``, correcting the mismatch between
the inference engine's and the trainer's log-probs (verl ``tis_imp_ratio_cap``); the weight is
``rollout_correction.truncated_is_weights`` at token level. The wider family (sequence-level TIS,
MIS, icepop, geometric-mean rejection) is ``rollout_correction.compute_rollout_correction``; its
weights come in as ``inputs.is_weights`` and multiply each token's loss the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rlhf_megatron.algorithms._checks import validated_mask, zero_padding
from rlhf_megatron.algorithms.aggregation import LossAggregation
from rlhf_megatron.algorithms.errors import InvalidConfigError, MissingInputError
from rlhf_megatron.algorithms.registry import Registry
from rlhf_megatron.algorithms.rollout_correction import truncated_is_weights
from rlhf_megatron.algorithms.stats import _mean

LOG_RATIO_CLAMP = 20.0  # vanilla: verl clamps logp - old to [-20, 20] before exp
GSPO_LOG_RATIO_MAX = 10.0  # gspo: verl clamps the sequence log-ratio at 10


@dataclass(frozen=True)
class PolicyLossInputs:
    """Inputs shared by every policy loss; all ``(bs, T)``.

    Attributes:
        log_prob: current policy's log-probs of the sampled tokens (requires grad).
        old_log_prob: the trainer's log-probs under the rollout-time weights (PPO's pi_old).
        advantages: per-token advantages.
        response_mask: 1 = real response token, 0 = padding.
        rollout_log_prob: the inference engine's log-probs of the same tokens (TIS; optional).
        is_weights: precomputed detached per-token IS weights (rollout correction; optional),
            multiplied into each token's loss (after TIS, if both are given).
    """

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_prob: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class PolicyLossConfig:
    """Hyperparameters of the policy losses (verl actor config names).

    Attributes:
        clip_ratio: symmetric clip range epsilon; the default of the two below.
        clip_ratio_low: ratio lower bound is ``1 - clip_ratio_low`` (None: ``clip_ratio``).
        clip_ratio_high: ratio upper bound is ``1 + clip_ratio_high`` (None: ``clip_ratio``);
            DAPO's clip-higher uses e.g. low 0.2, high 0.28.
        clip_ratio_c: dual-clip bound (> 1) for negative advantages; None turns dual clip off.
            vanilla only; verl default 3.0.
        tis_cap: truncation C of the TIS weight; None turns TIS off (verl: cap <= 0 is off).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= 1.0:
            raise InvalidConfigError(f"clip_ratio_low must be in [0, 1], got {self.low!r}")
        if not 0.0 <= self.high < float("inf"):
            raise InvalidConfigError(f"clip_ratio_high must be finite and >= 0, got {self.high!r}")
        if self.clip_ratio_c is not None and not 1.0 < self.clip_ratio_c < float("inf"):
            raise InvalidConfigError(
                f"clip_ratio_c (dual clip) must be > 1 or None, got {self.clip_ratio_c!r}"
            )
        if self.tis_cap is not None and not 0.0 < self.tis_cap < float("inf"):
            raise InvalidConfigError(f"tis_cap must be > 0 or None, got {self.tis_cap!r}")

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


PolicyLossFn = Callable[
    [PolicyLossInputs, PolicyLossConfig, LossAggregation],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def compute_policy_loss(
    name: str,
    inputs: PolicyLossInputs,
    config: PolicyLossConfig | None = None,
    aggregation: LossAggregation | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the policy loss registered as ``name`` (see the module docstring for papers).

    Args:
        name: a key of ``POLICY_LOSSES`` (unknown -> ``UnknownNameError``).
        inputs: ``(bs, T)`` log-probs, advantages and ``response_mask`` (1 = real response token,
            0 = padding).
        config: clip ranges, dual clip, TIS; default ``PolicyLossConfig()`` (verl defaults).
        aggregation: mode and global normaliser; default token-mean over this micro-batch.

    Returns:
        ``(loss, metrics)``: 0-dim loss (this micro-batch's share of the global loss) and 0-dim
        detached metric tensors.
    """
    return POLICY_LOSSES.get(name)(
        inputs, config or PolicyLossConfig(), aggregation or LossAggregation()
    )


@dataclass(frozen=True)
class _Prepared:
    mask: torch.Tensor  # bool (bs, T)
    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    tis_weight: torch.Tensor | None  # detached (bs, T) TIS x is_weights, or None when both off
    metrics: dict[str, torch.Tensor]


def _prepare(inputs: PolicyLossInputs, config: PolicyLossConfig) -> _Prepared:
    if config.tis_cap is not None and inputs.rollout_log_prob is None:
        raise MissingInputError("tis_cap is set but inputs.rollout_log_prob is None")
    mask = validated_mask(
        inputs.response_mask,
        log_prob=inputs.log_prob,
        old_log_prob=inputs.old_log_prob,
        advantages=inputs.advantages,
        rollout_log_prob=inputs.rollout_log_prob,
        is_weights=inputs.is_weights,
    )
    old = zero_padding(inputs.old_log_prob.detach(), mask)
    metrics: dict[str, torch.Tensor] = {}
    tis_weight = None
    if inputs.rollout_log_prob is not None:
        diff = old - zero_padding(inputs.rollout_log_prob.detach(), mask)
        metrics["rollout_kl"] = _mean(diff, mask)
        if config.tis_cap is not None:
            tis_weight = truncated_is_weights(diff, mask, "token", config.tis_cap)
        weight = tis_weight if tis_weight is not None else torch.ones_like(diff)
        metrics["tis_weight_mean"] = _mean(weight, mask)
    if inputs.is_weights is not None:
        extra = zero_padding(inputs.is_weights.detach(), mask)
        tis_weight = extra if tis_weight is None else tis_weight * extra
    return _Prepared(
        mask=mask,
        log_prob=zero_padding(inputs.log_prob, mask),
        old_log_prob=old,
        advantages=zero_padding(inputs.advantages.detach(), mask),
        tis_weight=tis_weight,
        metrics=metrics,
    )


def _ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    r = ratio.detach()
    one = torch.ones((), dtype=r.dtype, device=r.device)
    if mask.numel() == 0:
        return {"ratio_min": one, "ratio_max": one, "ratio_mean": one}
    has = mask.any()
    r_min = torch.where(mask, r, torch.full_like(r, float("inf"))).amin()
    r_max = torch.where(mask, r, torch.full_like(r, float("-inf"))).amax()
    return {
        "ratio_min": torch.where(has, r_min, one),
        "ratio_max": torch.where(has, r_max, one),
        "ratio_mean": torch.where(has, _mean(r, mask), one),
    }


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(
    inputs: PolicyLossInputs, config: PolicyLossConfig, aggregation: LossAggregation
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher and dual clip (verl ``vanilla``).

    With ``r = exp(clamp(logp - old, -20, 20))`` and ``A`` the advantage, per token:
    ``L = max(-A r, -A clip(r, 1 - low, 1 + high))``; for ``A < 0`` and dual clip on,
    ``L = min(L, -A c)``. Optionally times the TIS weight, then aggregated. Papers: PPO
    (arXiv:1707.06347), DAPO (arXiv:2503.14476), dual-clip PPO (arXiv:1912.09729).

    Args:
        inputs: ``(bs, T)`` tensors, see :class:`PolicyLossInputs`.
        config: clip ranges, dual-clip bound, TIS cap.
        aggregation: mode and global normaliser.

    Returns:
        ``(loss, metrics)``; metrics are 0-dim detached tensors (module docstring).
    """
    p = _prepare(inputs, config)
    log_ratio = torch.clamp(p.log_prob - p.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    adv = p.advantages
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - config.low, 1.0 + config.high)
    losses = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {
        "pg_clipfrac": _mean((loss_clipped > loss_unclipped).to(ratio.dtype), p.mask),
        "ppo_kl": _mean(-log_ratio.detach(), p.mask),
    }
    if config.clip_ratio_c is not None:
        loss_dual = -adv * config.clip_ratio_c
        lower_hit = (losses > loss_dual) & (adv < 0)
        losses = torch.where(adv < 0, torch.minimum(losses, loss_dual), losses)
        metrics["pg_clipfrac_lower"] = _mean(lower_hit.to(ratio.dtype), p.mask)
    else:
        metrics["pg_clipfrac_lower"] = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    if p.tis_weight is not None:
        losses = losses * p.tis_weight
    loss = aggregation.apply_validated(losses, p.mask)
    metrics = {k: v.detach() for k, v in {**metrics, **p.metrics}.items()}
    return loss, {**metrics, **_ratio_metrics(ratio, p.mask)}


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    inputs: PolicyLossInputs, config: PolicyLossConfig, aggregation: LossAggregation
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: clipped surrogate on the sequence-level importance ratio (arXiv:2507.18071).

    ``log s_i = mean_t(logp - old)`` over real tokens (geometric mean of token ratios); per token
    ``log s_it = sg[log s_i] + logp - sg[logp]``, clamped at 10, so the value is ``s_i`` and the
    gradient ``s_i * grad logp_t``. ``L = max(-A s, -A clip(s, 1 - low, 1 + high))``, optionally
    times the TIS weight, aggregated with ``seq-mean-token-mean``. ``clip_ratio_c`` is unused
    (``pg_clipfrac_lower`` is 0), as in verl. GSPO's paper uses tiny ranges (3e-4 / 4e-4).

    Returns:
        ``(loss, metrics)``; ratio metrics describe ``s_i`` (one value per sequence and token).
    """
    p = _prepare(inputs, config)
    token_log_ratio = p.log_prob - p.old_log_prob
    seq_len = p.mask.sum(dim=-1).clamp(min=1).to(token_log_ratio.dtype)
    seq_log_ratio = token_log_ratio.detach().sum(dim=-1) / seq_len  # padding already zeroed
    log_s = p.log_prob - p.log_prob.detach() + seq_log_ratio.unsqueeze(-1)
    s = torch.clamp(log_s, max=GSPO_LOG_RATIO_MAX).exp()
    adv = p.advantages
    loss_unclipped = -adv * s
    loss_clipped = -adv * torch.clamp(s, 1.0 - config.low, 1.0 + config.high)
    losses = torch.maximum(loss_unclipped, loss_clipped)
    if p.tis_weight is not None:
        losses = losses * p.tis_weight
    seq_agg = replace(aggregation, mode="seq-mean-token-mean")
    loss = seq_agg.apply_validated(losses, p.mask)
    metrics = {
        "pg_clipfrac": _mean((loss_clipped > loss_unclipped).to(s.dtype), p.mask),
        "pg_clipfrac_lower": torch.zeros((), dtype=s.dtype, device=s.device),
        "ppo_kl": _mean(-token_log_ratio.detach(), p.mask),
        **p.metrics,
    }
    metrics = {k: v.detach() for k, v in metrics.items()}
    return loss, {**metrics, **_ratio_metrics(s, p.mask)}
