"""Policy losses: PPO clip-higher, dual clip, GSPO, TIS; metrics, padding, layout, errors."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_megatron.algorithms import (
    POLICY_LOSSES,
    InvalidConfigError,
    LossAggregation,
    MissingInputError,
    NonFiniteInputError,
    PolicyLossConfig,
    PolicyLossInputs,
    compute_loss_normalizer,
    compute_policy_loss,
)

F64 = torch.float64
LOG = math.log


def _leaf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64, requires_grad=True)


def _hand_inputs() -> PolicyLossInputs:
    # token ratios 1.5, 0.5, 5.0, 1.1 against advantages +1, -1, -1, +2; last row token 2 padded
    old = torch.zeros(2, 2, dtype=F64)
    logp = _leaf([[LOG(1.5), LOG(0.5)], [LOG(5.0), LOG(1.1)]])
    adv = torch.tensor([[1.0, -1.0], [-1.0, 2.0]], dtype=F64)
    return PolicyLossInputs(logp, old, adv, torch.ones(2, 2))


def test_vanilla_ppo_by_hand_with_dual_clip() -> None:
    inputs = _hand_inputs()
    loss, metrics = compute_policy_loss("vanilla", inputs, PolicyLossConfig(clip_ratio=0.2))
    # per token: max(-1.5, -1.2) = -1.2 | max(.5, .8) = .8 | min(max(5, 1.2), 3) = 3 | -2.2
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 2.2) / 4)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)
    assert metrics["ppo_kl"].item() == pytest.approx(-(LOG(1.5) + LOG(0.5) + LOG(5) + LOG(1.1)) / 4)
    assert metrics["ratio_min"].item() == pytest.approx(0.5)
    assert metrics["ratio_max"].item() == pytest.approx(5.0)
    loss.backward()
    # clipped tokens carry no gradient; the unclipped one has d/dlogp(-A r) / 4 = -2 * 1.1 / 4
    expected = torch.tensor([[0.0, 0.0], [0.0, -2 * 1.1 / 4]], dtype=F64)
    torch.testing.assert_close(inputs.log_prob.grad, expected)


def test_clip_higher_and_dual_clip_switches() -> None:
    cfg = PolicyLossConfig(clip_ratio=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    loss, metrics = compute_policy_loss("vanilla", _hand_inputs(), cfg)
    # token 1 now clips at 1.28; token 3 keeps 5.0 without dual clip
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 5.0 - 2.2) / 4)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    low_only = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.6)  # bound 0.4 < ratio 0.5
    loss, _ = compute_policy_loss("vanilla", _hand_inputs(), low_only)
    assert loss.item() == pytest.approx((-1.2 + 0.5 + 3.0 - 2.2) / 4)


def test_vanilla_log_ratio_is_clamped_before_exp() -> None:
    inputs = PolicyLossInputs(
        _leaf([[50.0]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    )
    _, metrics = compute_policy_loss("vanilla", inputs)
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(20.0))
    assert metrics["ppo_kl"].item() == pytest.approx(-20.0)


def test_tis_multiplies_by_the_truncated_detached_weight() -> None:
    base = _hand_inputs()
    rollout = torch.tensor([[-LOG(3.0), 0.0], [LOG(2.0), -LOG(1.5)]], dtype=F64, requires_grad=True)
    inputs = PolicyLossInputs(
        base.log_prob, base.old_log_prob, base.advantages, base.response_mask, rollout
    )
    loss, metrics = compute_policy_loss("vanilla", inputs, PolicyLossConfig(tis_cap=2.0))
    # weights min(exp(old - rollout), 2) = 2 (capped from 3), 1, 0.5, 1.5
    assert loss.item() == pytest.approx((-1.2 * 2 + 0.8 * 1 + 3.0 * 0.5 - 2.2 * 1.5) / 4)
    assert metrics["tis_weight_mean"].item() == pytest.approx((2 + 1 + 0.5 + 1.5) / 4)
    assert metrics["rollout_kl"].item() == pytest.approx((LOG(3) + 0 - LOG(2) + LOG(1.5)) / 4)
    loss.backward()
    assert rollout.grad is None  # detached
    assert base.log_prob.grad[1, 1].item() == pytest.approx(-2 * 1.1 * 1.5 / 4)


def test_tis_needs_rollout_log_probs_and_is_off_by_default() -> None:
    with pytest.raises(MissingInputError, match="rollout_log_prob"):
        compute_policy_loss("vanilla", _hand_inputs(), PolicyLossConfig(tis_cap=2.0))
    base = _hand_inputs()
    rollout = torch.full((2, 2), -5.0, dtype=F64)
    with_rollout = PolicyLossInputs(
        base.log_prob, base.old_log_prob, base.advantages, base.response_mask, rollout
    )
    loss_a, metrics = compute_policy_loss("vanilla", with_rollout)
    loss_b, _ = compute_policy_loss("vanilla", _hand_inputs())
    assert loss_a.item() == pytest.approx(loss_b.item())
    assert metrics["tis_weight_mean"].item() == 1.0


def _gspo_inputs() -> PolicyLossInputs:
    logp = _leaf([[-0.5, -1.0, -2.0], [-0.3, -0.4, 0.0]])
    old = torch.tensor([[-0.6, -0.8, -2.1], [-0.5, -0.2, 7.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return PolicyLossInputs(logp, old, adv, mask)


def test_gspo_value_and_gradient_match_the_sequence_ratio_objective() -> None:
    inputs = _gspo_inputs()
    wide = PolicyLossConfig(clip_ratio=0.9, clip_ratio_high=10.0)
    loss, metrics = compute_policy_loss("gspo", inputs, wide)
    loss.backward()
    # reference: -A_i * exp(mean_t(logp - old)), averaged over sequences, autograd through it
    logp = inputs.log_prob.detach().clone().requires_grad_(True)
    mask = inputs.response_mask.to(F64)
    s = torch.exp(((logp - inputs.old_log_prob) * mask).sum(-1) / mask.sum(-1))
    reference = (-inputs.advantages[:, 0] * s).mean()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item())
    torch.testing.assert_close(inputs.log_prob.grad, logp.grad)
    assert metrics["pg_clipfrac"].item() == 0.0
    torch.testing.assert_close(metrics["ratio_max"], s.max().detach())


def test_gspo_clips_whole_sequences_and_ignores_the_token_mode() -> None:
    # sequence log-ratios: row 0 mean(.5, .2, .2) = .3 with A = +1; row 1 mean(-.4, -.2) = -.3
    # with A = -2; both fall outside GSPO's tight ranges, so both sequences are clipped
    def inputs() -> PolicyLossInputs:
        logp = _leaf([[0.5, 0.2, 0.2], [-0.4, -0.2, 9.0]])
        adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=F64)
        return PolicyLossInputs(
            logp, torch.zeros(2, 3, dtype=F64), adv, torch.tensor([[1, 1, 1], [1, 1, 0]])
        )

    tight = PolicyLossConfig(clip_ratio=3e-4, clip_ratio_high=4e-4)  # GSPO paper's ranges
    clipped = inputs()
    loss, metrics = compute_policy_loss("gspo", clipped, tight, LossAggregation("token-mean"))
    loss.backward()
    per_seq = [-1.0 * (1 + 4e-4), 2.0 * (1 - 3e-4)]  # max(-A s, -A clip(s)) picks the clip
    assert loss.item() == pytest.approx(sum(per_seq) / 2)  # seq-mean, not (3 a + 2 b) / 5
    assert torch.all(clipped.log_prob.grad == 0)
    assert metrics["pg_clipfrac"].item() == 1.0  # every real token belongs to a clipped seq
    assert metrics["ratio_min"].item() == pytest.approx(math.exp(-0.3))
    seq_mode, _ = compute_policy_loss(
        "gspo", inputs(), tight, LossAggregation("seq-mean-token-mean")
    )
    assert loss.item() == pytest.approx(seq_mode.item())  # verl: GSPO is always seq-mean-token-mean
    assert metrics["pg_clipfrac_lower"].item() == 0.0


def test_gspo_clipfrac_counts_tokens_of_clipped_sequences() -> None:
    logp = _leaf([[0.5, 0.5], [0.0, 0.0]])
    inputs = PolicyLossInputs(
        logp, torch.zeros(2, 2, dtype=F64), torch.ones(2, 2, dtype=F64), torch.ones(2, 2)
    )
    loss, metrics = compute_policy_loss("gspo", inputs, PolicyLossConfig(clip_ratio=0.2))
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)  # s_0 = e^.5 > 1.2, s_1 = 1
    loss.backward()
    assert torch.all(logp.grad[0] == 0) and torch.all(logp.grad[1] != 0)


def _random_inputs(seed: int, garbage: float | None = None) -> PolicyLossInputs:
    g = torch.Generator().manual_seed(seed)
    bs, width = 8, 5
    lengths = torch.randint(0, width + 1, (bs,), generator=g)
    lengths[0] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    logp = -torch.rand(bs, width, generator=g, dtype=F64) * 2
    old = logp + 0.3 * torch.randn(bs, width, generator=g, dtype=F64)
    rollout = old + 0.3 * torch.randn(bs, width, generator=g, dtype=F64)
    adv = torch.randn(bs, width, generator=g, dtype=F64)
    if garbage is not None:
        pad = ~mask.bool()
        logp, old, rollout, adv = (
            torch.where(pad, torch.full_like(x, garbage), x) for x in (logp, old, rollout, adv)
        )
    return PolicyLossInputs(logp.requires_grad_(True), old, adv, mask, rollout)


CFG = PolicyLossConfig(clip_ratio=0.2, clip_ratio_high=0.28, tis_cap=1.5)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -1e30])
def test_padding_never_changes_loss_metrics_or_grad(name: str, garbage: float) -> None:
    clean, dirty = _random_inputs(3), _random_inputs(3, garbage)
    loss_c, metrics_c = compute_policy_loss(name, clean, CFG)
    loss_d, metrics_d = compute_policy_loss(name, dirty, CFG)
    loss_c.backward()
    loss_d.backward()
    assert loss_d.item() == pytest.approx(loss_c.item())
    torch.testing.assert_close(dirty.log_prob.grad, clean.log_prob.grad)
    assert torch.all(dirty.log_prob.grad[~clean.response_mask.bool()] == 0)
    for key, value in metrics_c.items():
        torch.testing.assert_close(metrics_d[key], value, msg=key)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_split_gives_the_same_loss_and_grad(name: str, mode: str) -> None:
    full = _random_inputs(9)
    loss_full, _ = compute_policy_loss(name, full, CFG, LossAggregation(mode))
    loss_full.backward()
    split = _random_inputs(9)
    pieces = [slice(0, 3), slice(3, 4), slice(4, 8)]
    normalizer = sum(
        (compute_loss_normalizer(split.response_mask[p]) for p in pieces[1:]),
        compute_loss_normalizer(split.response_mask[pieces[0]]),
    )
    total = 0.0
    for p in pieces:
        part = PolicyLossInputs(
            *(
                None if x is None else x[p]
                for x in (
                    split.log_prob,
                    split.old_log_prob,
                    split.advantages,
                    split.response_mask,
                    split.rollout_log_prob,
                )
            )
        )
        loss, _ = compute_policy_loss(name, part, CFG, LossAggregation(mode, normalizer))
        total = total + loss
    total.backward()
    assert float(total) == pytest.approx(loss_full.item(), rel=1e-12)
    torch.testing.assert_close(split.log_prob.grad, full.log_prob.grad)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_metrics_are_detached_zero_dim_tensors(name: str) -> None:
    _, metrics = compute_policy_loss(name, _random_inputs(1), CFG)
    expected = {
        "pg_clipfrac",
        "pg_clipfrac_lower",
        "ppo_kl",
        "ratio_min",
        "ratio_max",
        "ratio_mean",
        "rollout_kl",
        "tis_weight_mean",
    }
    assert set(metrics) == expected
    for value in metrics.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_empty_micro_batch_gives_zero_loss_and_neutral_metrics(name: str) -> None:
    logp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    inputs = PolicyLossInputs(logp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    loss, metrics = compute_policy_loss(name, inputs)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0)
    assert metrics["ratio_min"].item() == 1.0 and metrics["pg_clipfrac"].item() == 0.0


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("field", ["log_prob", "old_log_prob", "advantages", "rollout_log_prob"])
def test_non_finite_real_input_is_a_typed_error(name: str, field: str) -> None:
    inputs = _random_inputs(4)
    tensors = {
        k: getattr(inputs, k)
        for k in ("log_prob", "old_log_prob", "advantages", "response_mask", "rollout_log_prob")
    }
    bad = tensors[field].detach().clone()
    bad[inputs.response_mask.bool()] = float("nan")
    tensors[field] = bad
    with pytest.raises(NonFiniteInputError, match=field):
        compute_policy_loss(name, PolicyLossInputs(**tensors), CFG)


def test_config_validation() -> None:
    with pytest.raises(InvalidConfigError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(InvalidConfigError, match="tis_cap"):
        PolicyLossConfig(tis_cap=0.0)
    with pytest.raises(InvalidConfigError, match="clip_ratio_low"):
        PolicyLossConfig(clip_ratio=1.5)
    assert PolicyLossConfig(clip_ratio=0.1, clip_ratio_high=0.3).low == 0.1
