"""Advantage estimators: hand-computed examples, properties, verl conventions, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_megatron.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    InsufficientDataError,
    InvalidConfigError,
    MissingInputError,
    NonFiniteInputError,
    ShapeMismatchError,
    compute_advantages,
    compute_gae,
    group_ids_from_uids,
    masked_whiten,
)

F64 = torch.float64


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def outcome_rewards(scores: list[float], lengths: list[int], width: int) -> torch.Tensor:
    """Outcome reward on the last real token of each right-padded response."""
    rewards = torch.zeros(len(scores), width, dtype=F64)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        if n:
            rewards[i, n - 1] = s
    return rewards


def right_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


# --------------------------------------------------------------------------------------- gae


def test_gae_by_hand() -> None:
    rewards, values = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # delta_2 = 1 - .7 = .3; delta_1 = .9*.7 - .6 = .03; delta_0 = .9*.6 - .5 = .04; gamma*lam=.72
    raw = t([[0.04 + 0.72 * (0.03 + 0.72 * 0.3), 0.03 + 0.72 * 0.3, 0.3]])
    adv, ret = compute_gae(rewards, values, mask.bool(), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, raw)
    torch.testing.assert_close(ret, raw + values)
    inputs = AdvantageInputs(rewards, mask, values=values)
    adv2, ret2 = compute_advantages("gae", inputs, AdvantageConfig(gamma=0.9, lam=0.8))
    torch.testing.assert_close(ret2, raw + values)
    torch.testing.assert_close(adv2, masked_whiten(raw, mask))  # verl whitens GAE advantages


@pytest.mark.parametrize("seed", range(5))
def test_gae_gamma_lambda_one_zero_values_is_reward_to_go(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (5,), generator=g).tolist()
    mask = right_padded_mask(lengths, 7)
    rewards = torch.randn(5, 7, generator=g, dtype=F64) * mask
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1) * mask
    inputs = AdvantageInputs(rewards, mask, values=torch.zeros(5, 7, dtype=F64))
    adv, ret = compute_advantages("gae", inputs, AdvantageConfig(gamma=1.0, lam=1.0))
    torch.testing.assert_close(ret, reward_to_go)
    torch.testing.assert_close(adv, masked_whiten(reward_to_go, mask))


def test_gae_skips_masked_positions_inside_a_response() -> None:
    """verl carries V and the running GAE over masked (e.g. tool-observation) tokens."""
    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(1, 5, generator=g, dtype=F64), torch.rand(1, 5, dtype=F64)
    mask = torch.tensor([[1, 0, 1, 0, 1]]).bool()
    keep = mask[0]
    dense, _ = compute_gae(rewards[:, keep], values[:, keep], torch.ones(1, 3).bool(), 0.95, 0.9)
    sparse, _ = compute_gae(rewards * mask, values * mask, mask, 0.95, 0.9)
    torch.testing.assert_close(sparse[:, keep], dense)
    assert torch.all(sparse[:, ~keep] == 0)


def test_gae_needs_values_and_two_real_tokens() -> None:
    with pytest.raises(MissingInputError, match="values"):
        compute_advantages("gae", AdvantageInputs(torch.zeros(2, 3), torch.ones(2, 3)))
    lonely = AdvantageInputs(torch.zeros(2, 3), t([[1, 0, 0], [0, 0, 0]]), values=torch.zeros(2, 3))
    with pytest.raises(InsufficientDataError):
        compute_advantages("gae", lonely)


# -------------------------------------------------------------------------------------- grpo


def test_grpo_by_hand_with_singleton_and_constant_groups() -> None:
    scores = [1.0, 0.0, 1.0, 5.0, 2.0, 2.0]
    lengths = [2, 3, 1, 2, 3, 3]
    group_ids = torch.tensor([0, 0, 0, 7, 3, 3])
    mask = right_padded_mask(lengths, 3)
    inputs = AdvantageInputs(outcome_rewards(scores, lengths, 3), mask, group_ids=group_ids)
    adv, ret = compute_advantages("grpo", inputs)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1]
    per_seq = [
        (1 / 3) / (std + 1e-6),
        (-2 / 3) / (std + 1e-6),
        (1 / 3) / (std + 1e-6),
        5.0 / (1.0 + 1e-6),  # a group of one: mean 0, std 1 (verl) -> the raw score
        0.0,  # all-equal rewards: zero, not NaN
        0.0,
    ]
    expected = torch.tensor(per_seq, dtype=F64)[:, None] * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, adv)


def test_dr_grpo_does_not_divide_by_std() -> None:
    inputs = AdvantageInputs(
        outcome_rewards([1.0, 0.0, 1.0], [1, 1, 1], 1),
        torch.ones(3, 1),
        group_ids=torch.zeros(3, dtype=torch.long),
    )
    adv, _ = compute_advantages("grpo", inputs, AdvantageConfig(norm_by_std=False))
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 / 3, -2 / 3, 1 / 3], dtype=F64))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_sum_to_zero_per_group(seed: int, norm_by_std: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    n_groups, group_size, width = 4, 5, 6
    bs = n_groups * group_size
    group_ids = torch.arange(n_groups).repeat_interleave(group_size)[
        torch.randperm(bs, generator=g)
    ]
    lengths = torch.randint(1, width + 1, (bs,), generator=g).tolist()
    mask = right_padded_mask(lengths, width)
    rewards = torch.randn(bs, width, generator=g, dtype=F64) * mask  # dense token rewards
    inputs = AdvantageInputs(rewards, mask, group_ids=group_ids)
    adv, _ = compute_advantages("grpo", inputs, AdvantageConfig(norm_by_std=norm_by_std))
    per_seq = adv[torch.arange(bs), torch.tensor(lengths) - 1]  # the broadcast value
    for gid in range(n_groups):
        assert abs(per_seq[group_ids == gid].sum().item()) < 1e-9
    # broadcast: every real token of a response carries the same advantage
    torch.testing.assert_close(adv, per_seq[:, None] * mask)
    if norm_by_std:
        for gid in range(n_groups):
            assert per_seq[group_ids == gid].std().item() == pytest.approx(1.0, rel=1e-4)


def test_grpo_empty_response_counts_as_score_zero_and_gets_zero_advantage() -> None:
    mask = t([[1, 1], [0, 0]])
    rewards = t([[0.0, 1.0], [float("nan"), 3.0]])  # the empty response's rewards are padding
    inputs = AdvantageInputs(rewards, mask, group_ids=torch.tensor([0, 0]))
    adv, _ = compute_advantages("grpo", inputs)
    s = 1 / math.sqrt(0.5)  # scores [1, 0]: mean .5, unbiased std sqrt(.5)
    torch.testing.assert_close(
        adv, t([[0.5 * s / (1 + 1e-6 * s), 0.5 * s / (1 + 1e-6 * s)], [0, 0]])
    )


def test_group_ids_from_uids_and_validation() -> None:
    ids = group_ids_from_uids(["b", "a", "b", "c", "a"])
    assert ids.tolist() == [0, 1, 0, 2, 1] and ids.dtype == torch.int64
    bad = AdvantageInputs(torch.zeros(2, 2), torch.ones(2, 2), group_ids=torch.tensor([0.0, 1.0]))
    with pytest.raises(ShapeMismatchError, match="group_ids"):
        compute_advantages("grpo", bad)
    with pytest.raises(MissingInputError, match="group_ids"):
        compute_advantages("rloo", AdvantageInputs(torch.zeros(2, 2), torch.ones(2, 2)))


# -------------------------------------------------------------------------------------- rloo


def test_rloo_is_score_minus_mean_of_the_others() -> None:
    scores = [3.0, 1.0, 2.0, 4.0]
    inputs = AdvantageInputs(
        outcome_rewards(scores, [2, 2, 1, 1], 2),
        right_padded_mask([2, 2, 1, 1], 2),
        group_ids=torch.tensor([0, 0, 0, 1]),
    )
    adv, ret = compute_advantages("rloo", inputs)
    expected = t([[3 - 1.5, 3 - 1.5], [1 - 2.5, 1 - 2.5], [2 - 2.0, 0], [4.0, 0]])  # singleton raw
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


# ------------------------------------------------------------------------------ reinforce++


def test_reinforce_plus_plus_by_hand() -> None:
    rewards = t([[1.0, 0.0, 2.0], [0.0, 3.0, 99.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages(
        "reinforce_plus_plus", AdvantageInputs(rewards, mask), AdvantageConfig(gamma=0.5)
    )
    expected_returns = t([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0]])
    torch.testing.assert_close(ret, expected_returns)
    real = torch.tensor([1.5, 1.0, 2.0, 1.5, 3.0], dtype=F64)  # mean 1.8, unbiased var .575
    whitened = (real - 1.8) / math.sqrt(0.575 + 1e-8)
    torch.testing.assert_close(adv[mask.bool()], whitened)
    assert torch.all(adv[~mask.bool()] == 0)


def test_reinforce_plus_plus_carries_the_return_across_masked_positions() -> None:
    """Issue 15's example: an observation span between two turns neither resets nor discounts
    the return (the old convention reset it to 0 and gave [0, 0, 1])."""
    rewards, mask = t([[0.0, 0.0, 1.0]]), t([[1, 0, 1]])
    cfg = AdvantageConfig(gamma=0.99)
    _, ret = compute_advantages("reinforce_plus_plus", AdvantageInputs(rewards, mask), cfg)
    torch.testing.assert_close(ret, t([[0.99, 0.0, 1.0]]))
    # a reward placed on the masked token is ignored, as everywhere else
    rewards = t([[0.0, 5.0, 1.0], [1.0, 1.0, 1.0]])
    mask = t([[1, 0, 1], [1, 1, 1]])
    _, ret = compute_advantages("reinforce_plus_plus", AdvantageInputs(rewards, mask))
    torch.testing.assert_close(ret, t([[1.0, 0.0, 1.0], [3.0, 2.0, 1.0]]))


def test_reinforce_plus_plus_baseline_by_hand() -> None:
    mask = t([[1, 1], [1, 0], [1, 1]])
    rewards = outcome_rewards([1.0, 0.0, 2.0], [2, 1, 2], 2)
    inputs = AdvantageInputs(rewards, mask, group_ids=torch.tensor([0, 0, 1]))
    adv, ret = compute_advantages("reinforce_plus_plus_baseline", inputs)
    centred = t([[0.5, 0.5], [-0.5, 0.0], [2.0, 2.0]])  # group of one: mean 0
    torch.testing.assert_close(adv, masked_whiten(centred, mask))
    torch.testing.assert_close(ret, adv)


# ------------------------------------------------------------------------------------- remax


def test_remax_subtracts_the_greedy_baseline() -> None:
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    inputs = AdvantageInputs(rewards, mask, baseline_rewards=torch.tensor([0.5, 1.0], dtype=F64))
    adv, ret = compute_advantages("remax", inputs)
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, t([[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]))
    with pytest.raises(MissingInputError, match="baseline_rewards"):
        compute_advantages("remax", AdvantageInputs(rewards, mask))


# ------------------------------------------------------------------------- all estimators


def _random_inputs(seed: int) -> AdvantageInputs:
    g = torch.Generator().manual_seed(seed)
    bs, width = 8, 6
    lengths = torch.randint(1, width + 1, (bs,), generator=g).tolist()
    lengths[3] = 0  # an empty response
    mask = right_padded_mask(lengths, width)
    return AdvantageInputs(
        token_level_rewards=torch.randn(bs, width, generator=g, dtype=F64) * mask,
        response_mask=mask,
        values=torch.randn(bs, width, generator=g, dtype=F64) * mask,
        group_ids=torch.arange(bs) // 3,  # groups of 3, 3 and 2
        baseline_rewards=torch.randn(bs, generator=g, dtype=F64),
    )


def _with_garbage(inputs: AdvantageInputs, garbage: float) -> AdvantageInputs:
    pad = ~inputs.response_mask.bool()
    empty_rows = pad.all(dim=-1)

    def dirty(x: torch.Tensor) -> torch.Tensor:
        where = pad if x.dim() == 2 else empty_rows
        return torch.where(where, torch.full_like(x, garbage), x)

    return AdvantageInputs(
        dirty(inputs.token_level_rewards),
        inputs.response_mask,
        dirty(inputs.values),
        inputs.group_ids,
        dirty(inputs.baseline_rewards),
    )


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
def test_padding_never_changes_advantages(name: str, garbage: float) -> None:
    clean = _random_inputs(11)
    cfg = AdvantageConfig(gamma=0.9, lam=0.95)
    adv, ret = compute_advantages(name, clean, cfg)
    adv_d, ret_d = compute_advantages(name, _with_garbage(clean, garbage), cfg)
    torch.testing.assert_close(adv_d, adv)
    torch.testing.assert_close(ret_d, ret)
    pad = ~clean.response_mask.bool()
    assert torch.all(adv[pad] == 0) and torch.all(ret[pad] == 0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.all(adv[3] == 0)  # the empty response


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_non_finite_real_input_is_a_typed_error(name: str) -> None:
    clean = _random_inputs(5)
    bad = clean.token_level_rewards.clone()
    bad[0, 0] = float("nan")
    inputs = AdvantageInputs(
        bad, clean.response_mask, clean.values, clean.group_ids, clean.baseline_rewards
    )
    with pytest.raises(NonFiniteInputError, match="token_level_rewards"):
        compute_advantages(name, inputs)


def test_non_finite_values_and_baselines_are_typed_errors() -> None:
    clean = _random_inputs(6)
    values = clean.values.clone()
    values[1, 0] = float("inf")
    with pytest.raises(NonFiniteInputError, match="values"):
        compute_advantages(
            "gae", AdvantageInputs(clean.token_level_rewards, clean.response_mask, values)
        )
    baseline = clean.baseline_rewards.clone()
    baseline[0] = float("nan")
    with pytest.raises(NonFiniteInputError, match="baseline_rewards"):
        compute_advantages(
            "remax",
            AdvantageInputs(
                clean.token_level_rewards, clean.response_mask, baseline_rewards=baseline
            ),
        )


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_estimators_do_not_track_gradients(name: str) -> None:
    clean = _random_inputs(2)
    rewards = clean.token_level_rewards.clone().requires_grad_(True)
    inputs = AdvantageInputs(
        rewards, clean.response_mask, clean.values, clean.group_ids, clean.baseline_rewards
    )
    adv, ret = compute_advantages(name, inputs)
    assert not adv.requires_grad and not ret.requires_grad


def test_config_validation() -> None:
    with pytest.raises(InvalidConfigError, match="gamma"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(InvalidConfigError, match="eps"):
        AdvantageConfig(eps=0.0)
    with pytest.raises(ShapeMismatchError):
        compute_advantages(
            "grpo",
            AdvantageInputs(
                torch.zeros(2, 3), torch.ones(2, 4), group_ids=torch.zeros(2, dtype=torch.long)
            ),
        )


# ------------------------------------------------------------- multi-turn masks (issue 15)


def _episodes(seed: int) -> tuple[AdvantageInputs, list[list[int]]]:
    """Multi-turn rows: assistant turns (mask 1) separated by observation spans (mask 0, holding
    NaN rewards and values, which must be ignored), then right padding. Turn-level rewards sit on
    the last token of each turn. Also returns, per row, the columns of its first observation."""
    g = torch.Generator().manual_seed(seed)
    bs, width = 8, 16
    mask = torch.zeros(bs, width, dtype=torch.long)
    rewards = torch.full((bs, width), float("nan"), dtype=F64)
    values = torch.full((bs, width), float("nan"), dtype=F64)
    spans = []
    for i in range(bs):
        col, first_obs = 0, []
        for turn in range(3):
            n = int(torch.randint(1, 4, (1,), generator=g))
            mask[i, col:col + n] = 1
            rewards[i, col:col + n] = 0.0
            rewards[i, col + n - 1] = float(torch.randn(1, generator=g, dtype=F64))
            values[i, col:col + n] = torch.randn(n, generator=g, dtype=F64)
            col += n
            if turn < 2:
                obs = int(torch.randint(1, 3, (1,), generator=g))
                first_obs = first_obs or list(range(col, col + obs))
                col += obs
        spans.append(first_obs)
    inputs = AdvantageInputs(rewards, mask, values, torch.arange(bs) // 4,
                             torch.randn(bs, generator=g, dtype=F64))
    return inputs, spans


def _drop_columns(inputs: AdvantageInputs, spans: list[list[int]]) -> AdvantageInputs:
    """Each row without its span, shifted left and right-padded (padding: mask 0, value 0)."""
    def drop(x: torch.Tensor, fill: float) -> torch.Tensor:
        out = torch.full_like(x, fill)
        for i, span in enumerate(spans):
            keep = [c for c in range(x.shape[1]) if c not in span]
            out[i, : len(keep)] = x[i, keep]
        return out

    return AdvantageInputs(drop(inputs.token_level_rewards, 0.0), drop(inputs.response_mask, 0),
                           drop(inputs.values, 0.0), inputs.group_ids, inputs.baseline_rewards)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_removing_an_observation_span_leaves_assistant_values_unchanged(name: str) -> None:
    """Every estimator treats mask-0 tokens as absent: GAE bootstraps V across them,
    REINFORCE++ carries the return across them, outcome estimators score the whole episode."""
    inputs, spans = _episodes(7)
    cfg = AdvantageConfig(gamma=0.9, lam=0.8)
    adv, ret = compute_advantages(name, inputs, cfg)
    adv2, ret2 = compute_advantages(name, _drop_columns(inputs, spans), cfg)
    mask, mask2 = inputs.response_mask.bool(), _drop_columns(inputs, spans).response_mask.bool()
    assert mask.sum() == mask2.sum() and all(span and not mask[i, span].any()
                                             for i, span in enumerate(spans))
    torch.testing.assert_close(adv[mask], adv2[mask2])
    torch.testing.assert_close(ret[mask], ret2[mask2])
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def test_gae_bootstraps_across_an_observation_by_hand() -> None:
    """mask [1, 0, 1], V = [0.5, nan, 0.25], r = [0, nan, 1], gamma = lam = 1: the first token's
    TD error uses V of the third token: A = [0 + 0.25 - 0.5 + (1 - 0.25), 0, 1 - 0.25]."""
    adv, _ = compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.0, 0.25]]),
                         torch.tensor([[True, False, True]]), 1.0, 1.0)
    torch.testing.assert_close(adv, t([[0.5, 0.0, 0.75]]))


def test_turn_level_rewards_score_the_episode_as_their_sum() -> None:
    """GRPO over episodes: rewards on the last token of each turn add up to the episode score,
    so turn-level rewards give the same advantages as their sum as one outcome reward."""
    mask = t([[1, 1, 0, 0, 1], [1, 0, 1, 1, 0]])
    turn = t([[0.0, 0.5, 0.0, 0.0, 1.0], [0.2, 0.0, 0.0, 0.1, 0.0]])
    outcome = t([[0.0, 0.0, 0.0, 0.0, 1.5], [0.0, 0.0, 0.0, 0.3, 0.0]])
    ids = torch.tensor([0, 0])
    a, _ = compute_advantages("grpo", AdvantageInputs(turn, mask, group_ids=ids))
    b, _ = compute_advantages("grpo", AdvantageInputs(outcome, mask, group_ids=ids))
    torch.testing.assert_close(a, b)
    std = math.sqrt(((1.5 - 0.9) ** 2 + (0.3 - 0.9) ** 2) / 1)
    torch.testing.assert_close(a[0, 0], torch.tensor(0.6 / (std + 1e-6), dtype=F64))


# ---------------------------------------------------------------- opo, gpg, grpo pass@k


def test_opo_uses_the_length_weighted_baseline_by_hand() -> None:
    """Group 0: scores 1 (3 tokens) and 0 (1 token): b = (3*1 + 1*0) / 4 = 0.75.
    Group 1 is a single response: baseline 0, advantage = its score."""
    mask = t([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    rewards = outcome_rewards([1.0, 0.0, 2.0], [3, 1, 2], 3)
    inputs = AdvantageInputs(rewards, mask, group_ids=torch.tensor([0, 0, 1]))
    adv, ret = compute_advantages("opo", inputs)
    torch.testing.assert_close(adv, t([[0.25] * 3, [-0.75, 0, 0], [2.0, 2.0, 0]]))
    torch.testing.assert_close(ret, adv)


def test_gpg_scales_by_batch_over_valid_responses_by_hand() -> None:
    """B = 6 responses; group 1 (three 0.1 scores) is all-equal, so M = 3 and alpha = 6 / 3 = 2.
    Group 0: scores 1, 0 (mean 0.5) -> +-1; group 2 is a single response (mean 0) -> 2 * 5."""
    scores = [1.0, 0.0, 0.1, 0.1, 0.1, 5.0]
    inputs = AdvantageInputs(outcome_rewards(scores, [2] * 6, 2), torch.ones(6, 2, dtype=F64),
                             group_ids=torch.tensor([0, 0, 1, 1, 1, 2]))
    adv, _ = compute_advantages("gpg", inputs)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, 0, 0, 0, 10.0], dtype=F64))


def test_grpo_passk_gives_only_the_best_response_the_gap_by_hand() -> None:
    """Group 0: scores 3, 1, 2 -> best 3, second 2: gap 1, std 1 -> 1 / (1 + 1e-6) on row 0.
    Group 1: a tie at 1 -> gap 0 for everyone."""
    scores = [3.0, 1.0, 2.0, 1.0, 1.0, 0.0]
    mask = torch.ones(6, 2, dtype=F64)
    inputs = AdvantageInputs(outcome_rewards(scores, [2] * 6, 2), mask,
                             group_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    adv, _ = compute_advantages("grpo_passk", inputs)
    expected = torch.tensor([1 / (1 + 1e-6), 0, 0, 0, 0, 0], dtype=F64)
    torch.testing.assert_close(adv[:, 0], expected)
    raw, _ = compute_advantages("grpo_passk", inputs, AdvantageConfig(norm_by_std=False))
    torch.testing.assert_close(raw[:, 1], torch.tensor([1.0, 0, 0, 0, 0, 0], dtype=F64))
    lonely = AdvantageInputs(outcome_rewards([1.0], [1], 1), torch.ones(1, 1),
                             group_ids=torch.tensor([0]))
    with pytest.raises(InsufficientDataError, match="two responses per group"):
        compute_advantages("grpo_passk", lonely)
