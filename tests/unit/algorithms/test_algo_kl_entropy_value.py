"""KL estimators, penalty, loss and controllers; entropy from logits; clipped value loss."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_megatron.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    InvalidConfigError,
    LossAggregation,
    MissingInputError,
    NonFiniteInputError,
    ShapeMismatchError,
    apply_kl_penalty,
    build_kl_controller,
    compute_kl,
    compute_kl_loss,
    compute_value_loss,
    entropy_from_logits,
)

F64 = torch.float64
LN2 = math.log(2.0)

# ---------------------------------------------------------------------------------------- KL

LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=F64)
REF = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=F64)  # d = +ln2, -ln2
ONES = torch.ones(1, 2)


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("kl", "k1"), [LN2, -LN2]),
        (("abs",), [LN2, LN2]),
        (("mse", "k2"), [0.5 * LN2**2, 0.5 * LN2**2]),
        (("low_var_kl", "k3"), [0.5 - 1 + LN2, 2.0 - 1 - LN2]),  # exp(-d) - 1 + d
    ],
)
def test_kl_estimators_by_hand(kinds: tuple[str, ...], expected: list[float]) -> None:
    for kind in kinds:
        torch.testing.assert_close(
            compute_kl(LOGP, REF, ONES, kind), torch.tensor([expected], dtype=F64)
        )


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("kl+", "k1+"), [LN2, -LN2]),
        (("abs+",), [LN2, LN2]),
        (("low_var_kl+", "k3+"), [0.5 - 1 + LN2, 2.0 - 1 - LN2]),
        (("mse+", "k2+"), [0.5 * LN2**2, 0.5 * LN2**2]),
    ],
)
def test_straight_through_kinds_have_the_kinds_value_and_k2s_gradient(
    kinds: tuple[str, ...], expected: list[float]
) -> None:
    """verl >= 0.5 '+' kinds: forward = the kind, backward = k2's d/dlogp = logp - ref
    (here +ln2 and -ln2, where k1's gradient would be 1 and abs's +-1)."""
    for kind in kinds:
        logp = LOGP.clone().requires_grad_(True)
        kl = compute_kl(logp, REF, ONES, kind)
        torch.testing.assert_close(kl.detach(), torch.tensor([expected], dtype=F64))
        kl.sum().backward()
        torch.testing.assert_close(logp.grad, torch.tensor([[LN2, -LN2]], dtype=F64))
    assert KL_ESTIMATORS.get("k2+") is KL_ESTIMATORS.get("k2")  # plain k2, not a wrapper


def test_straight_through_kl_loss_gradient_is_k2s_under_aggregation() -> None:
    logp = LOGP.clone().requires_grad_(True)
    loss, metrics = compute_kl_loss(logp, REF, ONES, "k1+", LossAggregation("token-sum"))
    assert loss.item() == pytest.approx(0.0)  # k1 values +ln2 and -ln2 cancel
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[LN2, -LN2]], dtype=F64))
    assert metrics["kl_mean"].item() == pytest.approx(0.0)


def test_k3_is_clamped_like_verl() -> None:
    logp = torch.tensor([[-100.0, 0.0, -30.0]], dtype=F64)
    ref = torch.tensor([[0.0, -100.0, 0.0]], dtype=F64)
    kl = compute_kl(logp, ref, torch.ones(1, 3), "low_var_kl")
    # ref - logp = 100 -> clamp 20 -> e^20 - 21 -> clamp 10; -100 -> clamp -20 -> e^-20 + 19 -> 10
    torch.testing.assert_close(kl, torch.tensor([[10.0, 10.0, 10.0]], dtype=F64))


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl() -> None:
    """Monte-Carlo check of Schulman's estimators against the exact KL(p || q)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=F64)
    true_kl = (p * (p / q).log()).sum().item()
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=g)
    logp, ref = p.log()[tokens][None], q.log()[tokens][None]
    mask = torch.ones_like(logp)
    for kind in ("k1", "k3"):
        assert compute_kl(logp, ref, mask, kind).mean().item() == pytest.approx(true_kl, abs=5e-3)
    k1 = compute_kl(logp, ref, mask, "k1")
    k3 = compute_kl(logp, ref, mask, "k3")
    assert k3.var() < k1.var() and torch.all(k3 >= 0)  # "low variance", non-negative


@pytest.mark.parametrize("kind", KL_ESTIMATORS.names())
def test_kl_padding_is_ignored_and_zero(kind: str) -> None:
    mask = torch.tensor([[1, 0]])
    dirty = torch.tensor([[math.log(0.5), float("nan")]], dtype=F64)
    kl = compute_kl(dirty, REF, mask, kind)
    assert kl[0, 1].item() == 0.0
    assert kl[0, 0].item() == compute_kl(LOGP, REF, ONES, kind)[0, 0].item()
    with pytest.raises(NonFiniteInputError, match="ref_logprob"):
        compute_kl(LOGP, torch.full_like(REF, float("inf")), mask, kind)


def test_apply_kl_penalty_by_hand() -> None:
    scores = torch.tensor([[0.0, 0.0, 1.0], [2.0, 5.0, 5.0]], dtype=F64)
    ref = torch.zeros(2, 3, dtype=F64)
    logp = torch.tensor([[0.1, 0.2, 0.3], [0.4, float("nan"), 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.5, kind="kl")
    expected = torch.tensor([[-0.05, -0.1, 0.85], [2.0 - 0.2, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out.token_level_rewards, expected)
    assert out.current_kl == pytest.approx((0.2 + 0.4) / 2)  # mean of per-sequence token means
    torch.testing.assert_close(out.kl, torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 0.0]], dtype=F64))


def test_kl_loss_value_and_gradient() -> None:
    logp = LOGP.clone().requires_grad_(True)
    loss, metrics = compute_kl_loss(logp, REF, ONES, "low_var_kl")
    assert loss.item() == pytest.approx(((0.5 - 1 + LN2) + (2.0 - 1 - LN2)) / 2)
    loss.backward()
    # d/dlogp [exp(ref - logp) - 1 + logp - ref] = 1 - exp(ref - logp), halved by token-mean
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.5 * (1 - 0.5), 0.5 * (1 - 2.0)]], dtype=F64)
    )
    assert metrics["kl_mean"].item() == pytest.approx(loss.item())
    summed, _ = compute_kl_loss(LOGP, REF, ONES, "kl", LossAggregation("seq-mean-token-sum"))
    assert summed.item() == pytest.approx(0.0)


def test_fixed_and_adaptive_controllers() -> None:
    fixed = FixedKLController(0.1)
    fixed.update(current_kl=100.0, n_steps=256)
    assert fixed.value == 0.1
    up = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    up.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2
    assert up.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10_000))
    down = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    down.update(current_kl=5.4, n_steps=100)  # error -0.1, inside the clip
    assert down.value == pytest.approx(0.1 * (1 - 0.1 * 100 / 10_000))


def test_build_kl_controller() -> None:
    assert isinstance(build_kl_controller("fixed", 0.2), FixedKLController)
    ctrl = build_kl_controller("adaptive", 0.2, target_kl=1.0, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.2
    with pytest.raises(MissingInputError, match="target_kl"):
        build_kl_controller("adaptive", 0.2)
    with pytest.raises(InvalidConfigError, match="horizon"):
        build_kl_controller("adaptive", 0.2, target_kl=1.0, horizon=0)
    with pytest.raises(InvalidConfigError, match="kl_coef"):
        FixedKLController(-1.0)


# ----------------------------------------------------------------------------------- entropy


def test_entropy_by_hand_and_against_the_definition() -> None:
    uniform = torch.zeros(1, 1, 4, dtype=F64)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(4))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g, dtype=F64) * 3
    p = logits.softmax(-1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    assert entropy_from_logits(logits).shape == (2, 3)


def test_entropy_is_stable_for_extreme_logits() -> None:
    peaked = torch.tensor([[[1000.0, 0.0, 0.0]]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    base = torch.tensor([[[0.25, -1.25, 2.0, 0.0]]])  # exact after adding 1e4 in float32
    shifted = (base + 1e4).requires_grad_(True)  # float32: naive lse - sum(p z) loses digits
    h = entropy_from_logits(shifted)
    assert h.item() == pytest.approx(entropy_from_logits(base).item(), abs=1e-5)
    h.sum().backward()
    assert torch.isfinite(shifted.grad).all()
    with pytest.raises(NonFiniteInputError):
        entropy_from_logits(torch.tensor([[[float("nan"), 0.0]]]), check_finite=True)
    with pytest.raises(ShapeMismatchError):
        entropy_from_logits(torch.zeros(2, 0))


def test_entropy_gradient_matches_the_analytic_form() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 1, 5, generator=g, dtype=F64, requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    p = logits.detach().softmax(-1)
    logp = p.log()
    expected = -p * (logp + entropy_from_logits(logits.detach())[..., None])  # dH/dz_k
    torch.testing.assert_close(logits.grad, expected)


# -------------------------------------------------------------------------------- value loss


def test_value_loss_by_hand() -> None:
    vpreds = torch.tensor([[1.0, 0.2, 123.0]], dtype=F64, requires_grad=True)
    values = torch.tensor([[0.0, 0.0, float("nan")]], dtype=F64)
    returns = torch.tensor([[2.0, 0.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.5)
    # token 0: clip(1.0) = 0.5 -> max((1-2)^2, (0.5-2)^2) = 2.25; token 1: 0.04 both ways
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.04) / 2)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["vpred_mean"].item() == pytest.approx(0.6)
    loss.backward()
    # token 0 takes the clipped (constant) branch; token 1: 0.5 * 2 * 0.2 / 2
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 0.1, 0.0]], dtype=F64))


def test_value_loss_uses_the_unclipped_error_when_it_is_larger() -> None:
    vpreds = torch.tensor([[0.4]], dtype=F64, requires_grad=True)  # inside the clip range
    loss, metrics = compute_value_loss(
        vpreds,
        torch.zeros(1, 1, dtype=F64),
        torch.full((1, 1), -1.0, dtype=F64),
        torch.ones(1, 1),
        0.1,
    )
    # clip(0.4) = 0.1: (0.1+1)^2 = 1.21 < (0.4+1)^2 = 1.96 -> unclipped
    assert loss.item() == pytest.approx(0.5 * 1.96)
    assert metrics["vf_clipfrac"].item() == 0.0
    with pytest.raises(InvalidConfigError, match="cliprange_value"):
        compute_value_loss(vpreds, vpreds, vpreds, torch.ones(1, 1), 0.0)
