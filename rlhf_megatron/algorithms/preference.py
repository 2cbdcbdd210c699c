"""The offline losses: DPO (sigmoid and IPO, registry DPO_LOSSES) and KTO on sequence
log-probabilities, and the SFT token loss.

Every input is a (n,) tensor of sequence log-probs: the sum over the completion's tokens of
log pi(y_t | x, y_<t), under the policy (with grad) or the frozen reference (no grad).

DPO (Rafailov et al. 2023, eq. 7), with h = [log pi(y_w|x) - log pi_ref(y_w|x)]
                                            - [log pi(y_l|x) - log pi_ref(y_l|x)]:
    sigmoid:  L = -log sigma(beta * h)
IPO (Azar et al. 2023, eq. 17, tau = beta):
    ipo:      L = (h - 1 / (2 beta))^2
Implicit rewards: beta * (log pi(y|x) - log pi_ref(y|x)) of the chosen and the rejected.

KTO (Ethayarajh et al. 2024, eq. 8), r(x, y) = log pi(y|x) - log pi_ref(y|x):
    z0 = max(0, mean over mismatched pairs (x_i, y_j) of r(x_i, y_j)), detached
    v  = lambda_D sigma(beta (r - z0))  if y is desirable
         lambda_U sigma(beta (z0 - r))  if y is undesirable
    L  = lambda_y - v
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf_megatron.algorithms.registry import Registry

DPO_LOSSES: Registry = Registry("DPO loss")
"""``algorithm.offline.dpo_loss``: ``fn(h, beta) -> (n,) losses`` of the pairs' log-ratio
differences h."""


@DPO_LOSSES.register("sigmoid")
def _sigmoid_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    return -F.logsigmoid(beta * h)


@DPO_LOSSES.register("ipo")
def _ipo_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    return (h - 1.0 / (2.0 * beta)) ** 2


@dataclass(frozen=True)
class PreferenceTerms:
    """Per-example losses (n,) with grad, and the detached implicit rewards (n,)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor, *, beta: float, kind: str = "sigmoid",
) -> PreferenceTerms:
    """Per-pair DPO/IPO losses; all inputs (n,) sequence log-probs of n pairs."""
    loss = DPO_LOSSES.get(kind)
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0")
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    losses = loss(chosen_logratio - rejected_logratio, beta)
    return PreferenceTerms(losses, beta * chosen_logratio.detach(),
                           beta * rejected_logratio.detach())


def kto_reference_point(policy_mismatched: torch.Tensor, ref_mismatched: torch.Tensor) -> float:
    """z0: the batch KL estimate max(0, mean(log pi - log pi_ref)) over mismatched (x_i, y_j)
    pairs, (n,) each; a plain float, so no gradient flows through it."""
    return max(0.0, float((policy_mismatched - ref_mismatched).float().mean()))


def kto_loss(
    policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, *, kl_ref: float,
    beta: float, lambda_d: float, lambda_u: float,
) -> PreferenceTerms:
    """Per-example KTO losses. policy, ref: (n,) sequence log-probs; desirable: (n,) bool or
    0/1; kl_ref: z0 (>= 0, see kto_reference_point). Rewards: beta * r, reported under
    chosen_rewards for desirable examples and rejected_rewards for undesirable ones (0 else)."""
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0")
    good = desirable.bool()
    logratio = policy - ref
    value = torch.where(good, lambda_d * torch.sigmoid(beta * (logratio - kl_ref)),
                        lambda_u * torch.sigmoid(beta * (kl_ref - logratio)))
    weight = torch.where(good, torch.full_like(value, lambda_d), torch.full_like(value, lambda_u))
    rewards = beta * logratio.detach()
    zero = torch.zeros_like(rewards)
    return PreferenceTerms(weight - value, torch.where(good, rewards, zero),
                           torch.where(good, zero, rewards))


def sft_token_loss_sum(token_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the masked tokens: (b, s) -> scalar (divide by the
    global token count for the token mean)."""
    return -(token_logprobs * loss_mask).sum()
