"""Rollout correction: token/sequence TIS, MIS, icepop, geometric-mean rejection, by hand.

Every case is written as log-ratios ``d = target - rollout`` of exact ratios, so the expected
weights and masks can be read off the comments.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_megatron.algorithms import (
    InvalidConfigError,
    LossAggregation,
    NonFiniteInputError,
    PolicyLossConfig,
    PolicyLossInputs,
    RolloutCorrectionConfig,
    compute_loss_normalizer,
    compute_policy_loss,
    compute_rollout_correction,
)

F64 = torch.float64
LOG = math.log
P = "rollout_corr/"

# Row 0: ratios 3, 0.5, 1 (product 1.5, geo-mean 1.5 ** (1/3)); row 1: ratios 1.2, 1.5 and one
# padding token (product 1.8, geo-mean sqrt(1.8)); row 2: empty.
RATIOS = [[3.0, 0.5, 1.0], [1.2, 1.5, 7.0], [1.0, 1.0, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])


def _correct(**kwargs: object):
    rollout = torch.zeros(3, 3, dtype=F64)
    target = torch.tensor([[LOG(r) for r in row] for row in RATIOS], dtype=F64)
    return compute_rollout_correction(target, rollout, MASK, RolloutCorrectionConfig(**kwargs))


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_off_by_default_weights_one_mask_unchanged() -> None:
    assert not RolloutCorrectionConfig().enabled
    out = _correct()
    torch.testing.assert_close(out.weights, MASK.to(F64))
    assert torch.equal(out.mask, MASK.bool())
    assert out.metrics[P + "masked_frac"].item() == 0.0
    assert out.metrics[P + "is_weight_mean"].item() == 1.0


def test_token_tis_truncates_each_token_at_the_cap() -> None:
    out = _correct(is_level="token", is_cap=2.0)
    torch.testing.assert_close(out.weights, _t([[2.0, 0.5, 1.0], [1.2, 1.5, 0.0], [0, 0, 0]]))
    assert torch.equal(out.mask, MASK.bool())
    m = out.metrics
    assert m[P + "is_truncated_frac"].item() == pytest.approx(1 / 5)
    assert m[P + "is_weight_max"].item() == pytest.approx(3.0)  # before truncation
    assert m[P + "is_weight_mean"].item() == pytest.approx((2 + 0.5 + 1 + 1.2 + 1.5) / 5)
    assert m[P + "log_ratio_mean"].item() == pytest.approx(
        (LOG(3) + LOG(0.5) + LOG(1.2) + LOG(1.5)) / 5
    )


def test_sequence_tis_uses_the_product_of_the_row_ratios() -> None:
    out = _correct(is_level="sequence", is_cap=1.6)
    # row 0: 3 * 0.5 * 1 = 1.5 (kept); row 1: 1.2 * 1.5 = 1.8 -> 1.6 (padding's 7 ignored)
    torch.testing.assert_close(out.weights, _t([[1.5] * 3, [1.6, 1.6, 0.0], [0, 0, 0]]))
    assert out.metrics[P + "is_truncated_frac"].item() == pytest.approx(2 / 5)
    assert out.metrics[P + "is_weight_max"].item() == pytest.approx(1.8)


def test_token_mis_rejects_tokens_over_the_cap_and_keeps_the_others_weights() -> None:
    out = _correct(is_level="token", is_mode="mask", is_cap=1.4)
    # ratio 3 and 1.5 rejected; 0.5, 1, 1.2 kept with their untruncated weight
    assert out.mask.tolist() == [[False, True, True], [True, False, False], [False] * 3]
    torch.testing.assert_close(out.weights, _t([[0.0, 0.5, 1.0], [1.2, 0.0, 0.0], [0, 0, 0]]))
    assert out.metrics[P + "mis_masked_frac"].item() == pytest.approx(2 / 5)
    assert out.metrics[P + "masked_frac"].item() == pytest.approx(2 / 5)
    assert out.metrics[P + "is_weight_mean"].item() == pytest.approx((0.5 + 1 + 1.2) / 3)


def test_sequence_mis_rejects_whole_sequences() -> None:
    out = _correct(is_level="sequence", is_mode="mask", is_cap=1.6)
    assert out.mask.tolist() == [[True] * 3, [False] * 3, [False] * 3]
    torch.testing.assert_close(out.weights, _t([[1.5] * 3, [0, 0, 0], [0, 0, 0]]))
    assert out.metrics[P + "mis_masked_frac"].item() == pytest.approx(2 / 5)


def test_icepop_masks_tokens_outside_the_range_without_weights() -> None:
    out = _correct(icepop_low=0.6, icepop_high=1.4)
    # 3 (too high), 0.5 (too low) and 1.5 (too high) masked
    assert out.mask.tolist() == [[False, False, True], [True, False, False], [False] * 3]
    torch.testing.assert_close(out.weights, _t([[0, 0, 1.0], [1.0, 0, 0], [0, 0, 0]]))
    assert out.metrics[P + "icepop_masked_frac"].item() == pytest.approx(3 / 5)


def test_icepop_with_token_is_is_the_papers_objective() -> None:
    out = _correct(is_level="token", is_cap=10.0, icepop_low=0.4, icepop_high=2.0)
    # M(k) = k inside [0.4, 2], 0 outside: only the ratio 3 falls out
    torch.testing.assert_close(out.weights, _t([[0.0, 0.5, 1.0], [1.2, 1.5, 0.0], [0, 0, 0]]))


def test_geometric_mean_rejection_drops_whole_sequences() -> None:
    # geo-means 1.5 ** (1/3) = 1.1447 and sqrt(1.8) = 1.3416
    out = _correct(geo_high=1.2)
    assert out.mask.tolist() == [[True] * 3, [False] * 3, [False] * 3]
    assert out.metrics[P + "geo_rejected_frac"].item() == pytest.approx(1 / 2)  # of 2 non-empty
    assert out.metrics[P + "masked_frac"].item() == pytest.approx(2 / 5)
    # default lower bound 1 / geo_high; an explicit one above 1 / 1.1447 rejects row 0 too
    both = _correct(geo_high=1.4, geo_low=0.9)
    assert both.mask.any(-1).tolist() == [True, True, False]
    assert not _correct(geo_high=1.1, geo_low=0.9).mask.any()


def test_padding_garbage_never_changes_a_result() -> None:
    target = torch.tensor([[LOG(r) for r in row] for row in RATIOS], dtype=F64)
    dirty = target.clone()
    dirty[1, 2] = float("nan")
    dirty[2] = float("inf")
    cfg = RolloutCorrectionConfig(is_level="sequence", icepop_low=0.4, icepop_high=2.0,
                                  geo_high=1.5)
    clean = compute_rollout_correction(target, torch.zeros(3, 3), MASK, cfg)
    out = compute_rollout_correction(dirty, torch.zeros(3, 3), MASK, cfg)
    torch.testing.assert_close(out.weights, clean.weights)
    assert torch.equal(out.mask, clean.mask)
    dirty[0, 0] = float("nan")
    with pytest.raises(NonFiniteInputError, match="target_logprob"):
        compute_rollout_correction(dirty, torch.zeros(3, 3), MASK, cfg)


def test_outputs_are_detached_and_the_log_weight_is_bounded() -> None:
    target = torch.tensor([[30.0, 0.0]], dtype=F64, requires_grad=True)
    out = compute_rollout_correction(target, torch.zeros(1, 2), torch.ones(1, 2),
                                     RolloutCorrectionConfig(is_level="token", is_cap=1e12))
    assert not out.weights.requires_grad
    assert out.weights[0, 0].item() == pytest.approx(math.exp(20.0))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(is_level="tokens"), "is_level"),
        (dict(is_mode="clip"), "is_mode"),
        (dict(is_cap=0.0), "is_cap"),
        (dict(icepop_low=0.5), "together"),
        (dict(icepop_low=2.0, icepop_high=1.0), "icepop_low"),
        (dict(geo_high=0.9), "geo_high"),
        (dict(geo_low=0.5), "geo_high"),
        (dict(geo_high=1.1, geo_low=1.5), "geo_low"),
    ],
)
def test_bad_config_is_one_line(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match) as info:
        RolloutCorrectionConfig(**kwargs)
    assert "\n" not in str(info.value)


def _random(bs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(bs, 6, generator=g) < 0.8).long()
    mask[1] = 0  # an empty row
    old = torch.randn(bs, 6, generator=g, dtype=F64) * 0.5
    return {
        "logp": (old + 0.3 * torch.randn(bs, 6, generator=g, dtype=F64)),
        "old": old,
        "rollout": old + 0.3 * torch.randn(bs, 6, generator=g, dtype=F64),
        "adv": torch.randn(bs, 6, generator=g, dtype=F64),
        "mask": mask,
    }


FULL_CFG = RolloutCorrectionConfig(is_level="sequence", is_cap=1.5, icepop_low=0.6,
                                   icepop_high=1.6, geo_high=1.15)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_corrected_loss_is_split_invariant_and_equals_the_hand_formula(mode: str) -> None:
    """Corrections computed per micro-batch and the normaliser counted on the corrected masks
    give the whole batch's loss and gradient (the engine's recipe)."""
    x = _random(10)
    whole = compute_rollout_correction(x["old"], x["rollout"], x["mask"], FULL_CFG)
    assert 0 < whole.metrics[P + "masked_frac"].item() < 1  # both outcomes exercised
    logp = x["logp"].clone().requires_grad_(True)
    ref_loss, _ = compute_policy_loss(
        "vanilla", PolicyLossInputs(logp, x["old"], x["adv"], whole.mask, is_weights=whole.weights),
        PolicyLossConfig(), LossAggregation(mode),
    )
    ref_loss.backward()
    # the same by hand: weights times the PPO token loss, over the kept tokens only
    ratio = torch.exp(x["logp"] - x["old"])
    per_token = torch.maximum(-x["adv"] * ratio, -x["adv"] * ratio.clamp(0.8, 1.2))
    per_token = torch.where(x["adv"] < 0, torch.minimum(per_token, -x["adv"] * 3.0), per_token)
    if mode == "token-mean":  # the other modes are covered by the aggregation tests
        keep = whole.mask.to(F64)
        hand = (per_token * whole.weights * keep).sum() / keep.sum()
        assert ref_loss.item() == pytest.approx(hand.item(), rel=1e-12)

    pieces = [slice(0, 3), slice(3, 4), slice(4, 10)]
    parts = [compute_rollout_correction(x["old"][p], x["rollout"][p], x["mask"][p], FULL_CFG)
             for p in pieces]
    normalizer = compute_loss_normalizer(parts[0].mask)
    for part in parts[1:]:
        normalizer = normalizer + compute_loss_normalizer(part.mask)
    logp2 = x["logp"].clone().requires_grad_(True)
    total = 0.0
    for p, part in zip(pieces, parts, strict=True):
        loss, _ = compute_policy_loss(
            "vanilla",
            PolicyLossInputs(logp2[p], x["old"][p], x["adv"][p], part.mask,
                             is_weights=part.weights),
            PolicyLossConfig(), LossAggregation(mode, normalizer),
        )
        total = total + loss
    total.backward()
    assert float(total) == pytest.approx(ref_loss.item(), rel=1e-12)
    torch.testing.assert_close(logp2.grad, logp.grad)


def test_policy_loss_tis_cap_reuses_the_token_tis_weights() -> None:
    """The loss's own tis_cap and rollout correction's token TIS give the same loss."""
    x = _random(6, seed=3)
    tis, _ = compute_policy_loss(
        "vanilla",
        PolicyLossInputs(x["logp"], x["old"], x["adv"], x["mask"], x["rollout"]),
        PolicyLossConfig(tis_cap=1.3),
    )
    corr = compute_rollout_correction(x["old"], x["rollout"], x["mask"],
                                      RolloutCorrectionConfig(is_level="token", is_cap=1.3))
    via, _ = compute_policy_loss(
        "vanilla", PolicyLossInputs(x["logp"], x["old"], x["adv"], corr.mask,
                                    is_weights=corr.weights),
    )
    assert via.item() == pytest.approx(tis.item(), rel=1e-12)
    assert corr.metrics[P + "is_truncated_frac"].item() > 0
