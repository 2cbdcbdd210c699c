"""The mathematics of the trainer, in pure torch (no Ray, Megatron, vLLM or OmegaConf).

Families, each with one signature and a registry (``REGISTRY.get(name)``; an unknown name raises
``UnknownNameError`` listing the known ones):
  * advantage estimators  ``ADVANTAGE_ESTIMATORS``: ``fn(AdvantageInputs, AdvantageConfig)
    -> (advantages, returns)``: gae, grpo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk.
  * policy losses ``POLICY_LOSSES``: ``fn(PolicyLossInputs, PolicyLossConfig, LossAggregation)
    -> (loss, metrics)``: vanilla (PPO clip-higher + dual clip), gspo; optional TIS.
  * KL estimators ``KL_ESTIMATORS``: kl/k1, abs, mse/k2, low_var_kl/k3, and straight-through
    ``<kind>+`` (value of the kind, gradient of k2); KL controllers
    ``KL_CONTROLLERS``: fixed, adaptive.
  * loss aggregation modes ``AGGREGATION_MODES``: token-mean, token-sum, seq-mean-token-sum,
    seq-mean-token-mean, seq-mean-token-sum-norm, normalised by the *global* batch.
  * rollout correction (``rollout_correction.py``): token/sequence TIS, MIS, icepop token
    masking, geometric-mean sequence rejection (``compute_rollout_correction``), with metrics.
  * DAPO (``dapo.py``): dynamic-sampling group filter and overlong reward shaping.
Plus the clipped value loss, entropy from logits and masked statistics.

Shapes: ``(bs, T)`` per token (T = padded response length), ``(bs,)`` per sequence.
Mask: ``response_mask`` 1 = real response token, 0 = padding; padding never changes a result.
Numerics follow verl (``verl/trainer/ppo/core_algos.py``, ``verl/utils/torch_functional.py``);
see docs/ALGORITHMS.md for every convention.
"""

from rlhf_megatron.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageFn,
    AdvantageInputs,
    compute_advantages,
    compute_gae,
    group_ids_from_uids,
)
from rlhf_megatron.algorithms.aggregation import (
    AGGREGATION_MODES,
    LossAggregation,
    LossNormalizer,
    aggregate_loss,
    compute_loss_normalizer,
)
from rlhf_megatron.algorithms.dapo import (
    DynamicSamplingConfig,
    OverlongShapingConfig,
    informative_groups,
    overlong_penalty,
    shape_overlong,
)
from rlhf_megatron.algorithms.entropy import entropy_from_logits
from rlhf_megatron.algorithms.errors import (
    AlgorithmError,
    DuplicateNameError,
    InsufficientDataError,
    InvalidConfigError,
    InvalidMaskError,
    MissingInputError,
    NonFiniteInputError,
    ShapeMismatchError,
    UnknownNameError,
)
from rlhf_megatron.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLPenalty,
    apply_kl_penalty,
    build_kl_controller,
    compute_kl,
    compute_kl_loss,
)
from rlhf_megatron.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossFn,
    PolicyLossInputs,
    compute_policy_loss,
)
from rlhf_megatron.algorithms.registry import Registry
from rlhf_megatron.algorithms.rollout_correction import (
    RolloutCorrection,
    RolloutCorrectionConfig,
    compute_rollout_correction,
)
from rlhf_megatron.algorithms.stats import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf_megatron.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageFn",
    "AdvantageInputs",
    "AlgorithmError",
    "DuplicateNameError",
    "DynamicSamplingConfig",
    "FixedKLController",
    "InsufficientDataError",
    "InvalidConfigError",
    "InvalidMaskError",
    "KLController",
    "KLPenalty",
    "LossAggregation",
    "LossNormalizer",
    "MissingInputError",
    "NonFiniteInputError",
    "OverlongShapingConfig",
    "PolicyLossConfig",
    "PolicyLossFn",
    "PolicyLossInputs",
    "Registry",
    "RolloutCorrection",
    "RolloutCorrectionConfig",
    "ShapeMismatchError",
    "UnknownNameError",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_advantages",
    "compute_gae",
    "compute_kl",
    "compute_kl_loss",
    "compute_loss_normalizer",
    "compute_policy_loss",
    "compute_rollout_correction",
    "compute_value_loss",
    "entropy_from_logits",
    "group_ids_from_uids",
    "informative_groups",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "shape_overlong",
]
