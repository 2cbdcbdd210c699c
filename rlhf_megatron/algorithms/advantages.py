"""Advantage estimators: one signature, one registry.

Every estimator is ``fn(inputs: AdvantageInputs, config: AdvantageConfig) -> (advantages, returns)``
with both outputs ``(bs, T)``, computed under ``torch.no_grad()`` and exactly 0 at padding
positions. Look one up with ``ADVANTAGE_ESTIMATORS.get(name)`` or call
:func:`compute_advantages`; the trainer never special-cases an estimator. An estimator that needs
an optional input (``values``, ``group_ids``, ``baseline_rewards``) raises ``MissingInputError``.

Mask convention: ``response_mask`` 1 = real response (assistant) token, 0 = padding or a token
the policy did not produce (prompt, tool output, observation of a multi-turn episode). Rewards,
values and baselines at mask-0 positions are ignored (they may hold NaN): token- and turn-level
rewards must sit on assistant tokens (e.g. the last token of each turn). Outcome estimators (grpo,
rloo, reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk) use the episode score
``sum_t rewards * mask``, so one row is one episode however many turns it has. An empty response
(all-zero mask) has score 0, still counts as a member of its group, and gets advantage 0.
Every estimator is invariant to removing a mask-0 span from inside a row: the values on the
assistant tokens do not change (tests/unit/algorithms/test_algo_advantages.py checks each).

verl conventions (``verl/trainer/ppo/core_algos.py``), kept so its hyperparameters carry over (not gpg's):
  * gae: advantages are whitened over the batch (``masked_whiten``); ``returns = A_raw + V``.
    Masked positions are *skipped* (value and running GAE carried over them, multi-turn style).
  * grpo: ``(s - mean) / (std + eps)`` with the unbiased group std (``torch.std``), eps=1e-6
    outside the root; ``norm_by_std=False`` is Dr. GRPO ``s - mean``. A group of one: mean 0,
    std 1, so the advantage is the raw score. All-equal rewards: advantage 0.
  * rloo: ``(s - mean) * n / (n - 1)`` = s minus the mean of the *other* samples; a group of one
    keeps its raw score.
  * reinforce_plus_plus: discounted return-to-go over the *real* tokens: masked positions are
    skipped (the running return is carried across them undiscounted), whitened over the batch;
    ``returns`` are the un-whitened returns. (verl first reset the return at every masked token,
    which gave earlier turns of a multi-turn episode no credit for the outcome; fixed there too.)
  * reinforce_plus_plus_baseline: ``s - group mean`` (group of one: mean 0) broadcast to every
    token, then whitened over the batch.
  * remax: return-to-go minus the greedy rollout's score; no whitening.
  * opo: ``s - b_g`` with the length-weighted baseline ``b_g = sum l_j s_j / sum l_j`` (l = real
    tokens of a response); a group of one has baseline 0. No std division, no whitening.
  * gpg: ``alpha * (s - mean_g)``, ``alpha = B / (B - M)`` with B the batch's responses and M
    those in groups whose scores are all equal (they carry no gradient); the paper's F_norm = 1.
    **Deviates from verl** (``B / count_nonzero(scores)`` counts non-zero rewards, so shifting the
    rewards changes the step): the paper's correction is about zero-gradient responses.
  * grpo_passk: only the best response of each group gets an advantage, ``s_max - s_second``,
    divided by ``std_g + eps`` when ``norm_by_std``; groups need >= 2 responses.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from rlhf_megatron.algorithms._checks import check_positive, validated_mask, zero_padding
from rlhf_megatron.algorithms.errors import (
    InsufficientDataError,
    InvalidConfigError,
    MissingInputError,
    ShapeMismatchError,
)
from rlhf_megatron.algorithms.registry import Registry
from rlhf_megatron.algorithms.stats import _whiten

AdvantageFn = Callable[["AdvantageInputs", "AdvantageConfig"], tuple[torch.Tensor, torch.Tensor]]

ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything any estimator may read; each uses the fields it needs.

    Attributes:
        token_level_rewards: ``(bs, T)`` reward per token (outcome rewards sit on the last real
            token; KL penalties, if applied as reward, on every token).
        response_mask: ``(bs, T)``; 1 = real response token, 0 = padding.
        values: ``(bs, T)`` critic values V(s_t) at rollout time (gae).
        group_ids: ``(bs,)`` int64 id of each response's prompt group (grpo, rloo,
            reinforce_plus_plus_baseline); see :func:`group_ids_from_uids`.
        baseline_rewards: ``(bs,)`` score of the greedy response to the same prompt (remax).
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    baseline_rewards: torch.Tensor | None = None


@dataclass(frozen=True)
class AdvantageConfig:
    """Hyperparameters shared by the estimators (each reads the ones it needs).

    Attributes:
        gamma: discount factor (gae, reinforce_plus_plus); verl default 1.0.
        lam: GAE lambda (gae); verl default 1.0.
        norm_by_std: grpo divides by the group std (True, DeepSeekMath) or not (False, Dr. GRPO);
            verl ``norm_adv_by_std_in_grpo``.
        eps: added to the group std, outside the root (grpo); verl 1e-6.
    """

    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InvalidConfigError(f"AdvantageConfig.{name} must be in [0, 1], got {value!r}")
        check_positive("AdvantageConfig.eps", self.eps)


def group_ids_from_uids(
    uids: Sequence[Hashable], device: torch.device | str | None = None
) -> torch.Tensor:
    """Map per-response prompt uids (any hashables, e.g. strings) to ``(bs,)`` int64 group ids."""
    index: dict[Hashable, int] = {}
    ids = [index.setdefault(uid, len(index)) for uid in uids]
    return torch.tensor(ids, dtype=torch.int64, device=device)


def compute_advantages(
    name: str, inputs: AdvantageInputs, config: AdvantageConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the advantage estimator registered as ``name`` (see the module docstring for papers).

    Args:
        name: a key of ``ADVANTAGE_ESTIMATORS`` (unknown -> ``UnknownNameError``).
        inputs: ``(bs, T)`` rewards and ``response_mask`` (1 = real response token, 0 = padding),
            plus the optional fields the estimator needs.
        config: hyperparameters; default ``AdvantageConfig()`` (verl defaults).

    Returns:
        ``(advantages, returns)``, both ``(bs, T)``, 0 at padding, without autograd history.
    """
    return ADVANTAGE_ESTIMATORS.get(name)(inputs, config or AdvantageConfig())


def _prepare(inputs: AdvantageInputs, estimator: str, *needs: str) -> tuple[torch.Tensor, ...]:
    """Validate and sanitise; returns (mask, rewards, *needed) with padding zeroed."""
    for field in needs:
        if getattr(inputs, field) is None:
            raise MissingInputError(f"advantage estimator {estimator!r} needs inputs.{field}")
    extra = {field: getattr(inputs, field) for field in needs}
    mask = validated_mask(
        inputs.response_mask, token_level_rewards=inputs.token_level_rewards, **extra
    )
    g = extra.get("group_ids")
    if g is not None and (g.dim() != 1 or g.is_floating_point() or g.is_complex()):
        raise ShapeMismatchError(
            f"group_ids must be an integer tensor of shape ({mask.shape[0]},), "
            f"got {g.dtype} {tuple(g.shape)}"
        )
    rewards = zero_padding(inputs.token_level_rewards, mask)
    rest = [v if k == "group_ids" else zero_padding(v, mask) for k, v in extra.items()]
    return (mask, rewards, *rest)


def _group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, unbiased group std, group size), each ``(bs,)``.

    Groups of size 1 get mean 0 and std 1 (verl), so their normalised score is the raw score.
    """
    group_ids = group_ids.to(scores.device)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    counts_f = counts.to(scores.dtype)
    sums = torch.zeros_like(counts_f).index_add_(0, inverse, scores)
    means = sums / counts_f
    sq = torch.zeros_like(counts_f).index_add_(0, inverse, (scores - means[inverse]) ** 2)
    stds = torch.sqrt(sq / (counts_f - 1).clamp(min=1))
    single = counts == 1
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(stds), stds)
    return means[inverse], stds[inverse], counts_f[inverse]


def _outcome(
    inputs: AdvantageInputs, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask, rewards, scores (bs,), group_ids) of an outcome estimator that needs groups."""
    mask, rewards, group_ids = _prepare(inputs, name, "group_ids")
    return mask, rewards, rewards.sum(dim=-1), group_ids.to(rewards.device)


def _group_outcome(inputs: AdvantageInputs, name: str) -> tuple[torch.Tensor, ...]:
    """(mask, scores, group mean, group std, group size) of an outcome estimator that compares
    each score with its group's statistics (_group_stats), the last four ``(bs,)``."""
    mask, _, scores, group_ids = _outcome(inputs, name)
    return (mask, scores, *_group_stats(scores, group_ids))


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bs,)`` per-response values on every real token, 0 at padding; as (A, A)."""
    adv = zero_padding(per_seq.unsqueeze(-1).expand(mask.shape), mask)
    return adv, adv


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GAE (Schulman et al. 2016, arXiv:1506.02438), no whitening.

    ``delta_t = r_t + gamma * V_next - V_t``; ``A_t = delta_t + gamma * lam * A_next``, where
    "next" is the next *real* token: masked positions are skipped, their value and running
    advantage carried over (verl). Expects sanitised inputs (padding zeroed) and a bool mask,
    all ``(bs, T)``. Returns ``(advantages, returns = advantages + values)``, 0 at padding.
    """
    next_value = rewards.new_zeros(rewards.shape[0])
    last_gae = rewards.new_zeros(rewards.shape[0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        real = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = torch.where(real, values[:, t], next_value)
        last_gae = torch.where(real, gae_t, last_gae)
        out[:, t] = last_gae
    out = zero_padding(out, mask)
    return out, zero_padding(out + values, mask)


@ADVANTAGE_ESTIMATORS.register("gae")
@torch.no_grad()
def gae_advantage(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE (Schulman et al. 2016), then whitened over the batch as verl does.

    Needs ``inputs.values`` ``(bs, T)``. Returns ``(masked_whiten(A_raw), A_raw + V)``, (bs, T).
    Raises ``InsufficientDataError`` if the batch has fewer than two real tokens (whitening).
    """
    mask, rewards, values = _prepare(inputs, "gae", "values")
    advantages, returns = compute_gae(rewards, values, mask, config.gamma, config.lam)
    return _whiten(advantages, mask), returns


@ADVANTAGE_ESTIMATORS.register("grpo")
@torch.no_grad()
def grpo_advantage(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    ``A_i = (s_i - mean_g) / (std_g + eps)`` (unbiased std) broadcast to every real token, or
    ``s_i - mean_g`` with ``norm_by_std=False`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783).
    Needs ``inputs.group_ids``. Returns ``(A, A)``, both (bs, T).
    """
    mask, scores, mean, std, _ = _group_outcome(inputs, "grpo")
    adv = scores - mean
    if config.norm_by_std:
        adv = adv / (std + config.eps)
    return _broadcast(adv, mask)


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo_advantage(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019).

    ``A_i = s_i - mean_{j != i} s_j = (s_i - mean_g) * n / (n - 1)``; a group of one keeps its raw
    score (verl). Needs ``inputs.group_ids``. Returns ``(A, A)``, both (bs, T).
    """
    mask, scores, mean, _, n = _group_outcome(inputs, "rloo")
    return _broadcast(torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores),
                      mask)


@ADVANTAGE_ESTIMATORS.register("opo")
@torch.no_grad()
def opo_advantage(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO's optimal baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline",
    arXiv:2505.23585; verl ``opo``): ``A_i = s_i - sum_j l_j s_j / sum_j l_j`` over the group,
    ``l_j`` the number of real tokens of response j. Group of one: baseline 0. Empty responses
    weigh 0 (a group of only empty responses has baseline 0). Needs ``inputs.group_ids``.
    Returns ``(A, A)``, (bs, T).
    """
    mask, _, scores, group_ids = _outcome(inputs, "opo")
    lengths = mask.sum(dim=-1).to(scores.dtype)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    weighted = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device)
    weighted.index_add_(0, inverse, lengths * scores)
    total = torch.zeros_like(weighted).index_add_(0, inverse, lengths)
    baseline = torch.where((counts > 1) & (total > 0), weighted / total.clamp(min=1), 0.0)
    return _broadcast(scores - baseline[inverse], mask)


@ADVANTAGE_ESTIMATORS.register("gpg")
@torch.no_grad()
def gpg_advantage(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546): ``A_i = alpha * (s_i - mean_g)`` with the paper's gradient
    correction ``alpha = B / (B - M)``: B responses in the batch, M of them in groups whose
    scores are all equal (zero advantage). F_norm = 1. A group of one has mean 0 (verl) and
    counts as valid. Needs ``inputs.group_ids``. Returns ``(A, A)``, (bs, T).
    """
    mask, _, scores, group_ids = _outcome(inputs, "gpg")
    mean, _, n = _group_stats(scores, group_ids)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    hi = scores.new_full((int(inverse.max()) + 1 if len(scores) else 0,), float("-inf"))
    lo = scores.new_full(hi.shape, float("inf"))
    hi = hi.scatter_reduce(0, inverse, scores, "amax")
    lo = lo.scatter_reduce(0, inverse, scores, "amin")
    invalid = (n > 1) & (hi == lo)[inverse]  # all-equal group: zero advantage, no gradient
    valid = scores.numel() - int(invalid.sum())
    alpha = scores.numel() / max(valid, 1)
    return _broadcast(alpha * (scores - mean), mask)


@ADVANTAGE_ESTIMATORS.register("grpo_passk")
@torch.no_grad()
def grpo_passk_advantage(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k (verl ``grpo_passk``, after arXiv:2503.19595): in each group only the
    best response gets an advantage, ``s_max - s_second_max`` (``/ (std_g + eps)`` with
    ``norm_by_std``, unbiased std); every other response gets 0. Ties go to the first best
    response in batch order (its advantage is then 0 anyway). Needs ``inputs.group_ids`` and
    groups of at least two responses (``InsufficientDataError`` otherwise). Returns ``(A, A)``.
    """
    mask, _, scores, group_ids = _outcome(inputs, "grpo_passk")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        raise InsufficientDataError("advantage estimator 'grpo_passk' needs at least two "
                                    "responses per group (rollout.sampling.n >= 2)")
    groups, bs = len(counts), len(scores)
    neg_inf = torch.full((groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = neg_inf.scatter_reduce(0, inverse, scores, "amax")
    position = torch.arange(bs, device=scores.device)
    candidates = torch.where(scores == best[inverse], position, bs)
    first = torch.full((groups,), bs, device=scores.device).scatter_reduce(
        0, inverse, candidates, "amin")
    is_best = position == first[inverse]
    second = neg_inf.scatter_reduce(0, inverse, torch.where(is_best, float("-inf"), scores), "amax")
    gap = best - second
    if config.norm_by_std:
        _, std, _ = _group_stats(scores, group_ids)
        gap = gap[inverse] / (std + config.eps)
    else:
        gap = gap[inverse]
    return _broadcast(torch.where(is_best, gap, torch.zeros_like(gap)), mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantage(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): token-level discounted returns, batch-whitened.

    ``G_t = r_t + gamma * G_next`` where "next" is the next *real* token: mask-0 positions
    (padding, tool observations) are skipped, the running return carried across them. Example:
    mask [1, 0, 1], rewards [0, 0, 1], gamma 0.99 -> G = [0.99, 0, 1].
    Returns ``(masked_whiten(G), G)``, both (bs, T).
    """
    mask, rewards = _prepare(inputs, "reinforce_plus_plus")
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + config.gamma * running, running)
        returns[:, t] = running
    returns = zero_padding(returns, mask)
    return _whiten(returns, mask), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantage(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): ``s_i - mean_g``, batch-whitened.

    A group of one has mean 0 (verl). Needs ``inputs.group_ids``. Returns ``(A, A)``, (bs, T).
    """
    mask, scores, mean, _, _ = _group_outcome(inputs, "reinforce_plus_plus_baseline")
    adv = _whiten(_broadcast(scores - mean, mask)[0], mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("remax")
@torch.no_grad()
def remax_advantage(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): return-to-go minus the greedy response's score.

    ``G_t = sum_{k >= t} r_k * mask_k`` (undiscounted); ``A_t = G_t - b`` with
    ``b = inputs.baseline_rewards`` ``(bs,)``. Returns ``(A, G)``, both (bs, T).
    """
    mask, rewards, baseline = _prepare(inputs, "remax", "baseline_rewards")
    returns = zero_padding(rewards.flip(-1).cumsum(-1).flip(-1), mask)
    adv = zero_padding(returns - baseline.unsqueeze(-1), mask)
    return adv, returns
