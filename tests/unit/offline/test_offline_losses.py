"""DPO / IPO / KTO losses against the papers' formulas on hand-computed cases, the beta -> 0
limits, and the per-micro-batch terms' split invariance (global-count normalisation)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_megatron.algorithms.preference import dpo_loss, kto_loss, kto_reference_point
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.engines.offline_update import (
    OfflineStepSpec,
    _dpo_terms,
    _kto_terms,
    _sft_terms,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# One pair: policy chosen -1.0, rejected -2.0; reference -1.5 for both, so
# h = (-1.0 + 1.5) - (-2.0 + 1.5) = 1.0.
PAIR = dict(policy_chosen=t(-1.0), policy_rejected=t(-2.0), ref_chosen=t(-1.5),
            ref_rejected=t(-1.5))


def test_dpo_sigmoid_equals_hand_computed_value_rewards_and_gradient():
    chosen = t(-1.0).requires_grad_()
    terms = dpo_loss(chosen, t(-2.0), t(-1.5), t(-1.5), beta=0.5, kind="sigmoid")
    # -log sigma(0.5 * 1.0) = log(1 + e^-0.5) = 0.4740770
    assert terms.losses.item() == pytest.approx(0.4740770, abs=1e-7)
    assert terms.chosen_rewards.item() == pytest.approx(0.25)   # 0.5 * 0.5
    assert terms.rejected_rewards.item() == pytest.approx(-0.25)
    terms.losses.sum().backward()
    # d/d logpi(y_w) = -beta * sigma(-beta h) = -0.5 * 0.3775407
    assert chosen.grad.item() == pytest.approx(-0.18877035, abs=1e-7)


@pytest.mark.parametrize("beta, expected", [(0.5, 0.0), (0.25, 1.0), (1.0, 0.25)])
def test_ipo_equals_squared_distance_to_one_over_two_beta(beta, expected):
    # (h - 1 / (2 beta))^2 with h = 1
    assert dpo_loss(**PAIR, beta=beta, kind="ipo").losses.item() == pytest.approx(expected)


def test_dpo_sigmoid_beta_to_zero_limit():
    # L = log 2 - beta h / 2 + O(beta^2): the loss tends to log 2 and its slope in beta to -h/2.
    for beta in (1e-3, 1e-5):
        loss = dpo_loss(**PAIR, beta=beta).losses.item()
        assert loss == pytest.approx(math.log(2), abs=beta)
        assert (loss - math.log(2)) / beta == pytest.approx(-0.5, rel=1e-2)


def test_dpo_rejects_unknown_kind_and_bad_beta():
    with pytest.raises(ValueError, match="hinge"):
        dpo_loss(**PAIR, beta=0.1, kind="hinge")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(**PAIR, beta=0.0)


def test_kto_equals_hand_computed_values():
    # r = [1, -1]; z0 = 0.2; beta 0.5; lambda_D 1, lambda_U 2
    terms = kto_loss(t(-1.0, -3.0), t(-2.0, -2.0), torch.tensor([True, False]), kl_ref=0.2,
                     beta=0.5, lambda_d=1.0, lambda_u=2.0)
    # desirable: 1 - sigma(0.5 * (1 - 0.2)) = 1 - sigma(0.4) = 0.4013123
    # undesirable: 2 - 2 sigma(0.5 * (0.2 + 1)) = 2 - 2 sigma(0.6) = 0.7086874
    assert terms.losses.tolist() == pytest.approx([0.4013123, 0.7086874], abs=1e-7)
    assert terms.chosen_rewards.tolist() == pytest.approx([0.5, 0.0])
    assert terms.rejected_rewards.tolist() == pytest.approx([0.0, -0.5])


def test_kto_beta_to_zero_limit_is_half_the_weights():
    terms = kto_loss(t(-1.0, -3.0), t(-2.0, -2.0), torch.tensor([1.0, 0.0]), kl_ref=0.2,
                     beta=1e-7, lambda_d=1.0, lambda_u=2.0)
    assert terms.losses.tolist() == pytest.approx([0.5, 1.0], abs=1e-6)


def test_kto_reference_point_is_the_clamped_mean_of_mismatched_log_ratios():
    assert kto_reference_point(t(-1.0, -1.0), t(-1.5, -1.5)) == pytest.approx(0.5)
    assert kto_reference_point(t(-1.0, -2.0), t(-1.5, -1.5)) == pytest.approx(0.0)
    assert kto_reference_point(t(-2.0, -2.0), t(-1.0, -1.0)) == 0.0  # clamped at 0
    policy = t(-1.0, -1.0).requires_grad_()
    assert isinstance(kto_reference_point(policy, t(-1.5, -1.5)), float)  # detached


def _rows(n: int, **fields: torch.Tensor) -> TokenBatch:
    ids = torch.ones(n, 3, dtype=torch.long)
    return TokenBatch(ids, torch.ones_like(ids), torch.ones(n, 3), fields)


@pytest.mark.parametrize("algorithm", ["sft", "dpo", "kto"])
def test_micro_batch_terms_sum_to_the_batch_mean_however_split(algorithm):
    torch.manual_seed(0)
    token_lp = -torch.rand(8, 3, dtype=torch.float64)
    seq = token_lp.sum(-1)
    fields = {"ref_seq_logps": -torch.rand(8, dtype=torch.float64) * 3,
              "desirable": torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1])}
    count = {"sft": 24.0, "dpo": 4.0, "kto": 8.0}[algorithm]
    spec = OfflineStepSpec(algorithm, count, beta=0.3, kl_ref=0.1, global_desirable=5,
                           global_undesirable=3)
    terms = {"sft": _sft_terms, "dpo": _dpo_terms, "kto": _kto_terms}[algorithm]
    whole, whole_m = terms(token_lp, seq, _rows(8, **fields), spec)
    parts = [terms(token_lp[a:b], seq[a:b], _rows(b - a, **{k: v[a:b] for k, v in fields.items()}),
                   spec) for a, b in ((0, 2), (2, 6), (6, 8))]
    assert sum(p[0] for p in parts).item() == pytest.approx(whole.item(), rel=1e-12)
    for name, value in whole_m.items():
        assert sum(p[1][name] for p in parts) == pytest.approx(value, rel=1e-9, abs=1e-12)
    if algorithm == "dpo":  # the batch mean of the paper's loss
        ref = fields["ref_seq_logps"]
        h = (seq[0::2] - ref[0::2]) - (seq[1::2] - ref[1::2])
        assert whole.item() == pytest.approx(-torch.nn.functional.logsigmoid(0.3 * h).mean().item())
