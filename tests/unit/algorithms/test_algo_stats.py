"""Masked statistics: hand-computed values, verl conventions, padding and error handling."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_megatron.algorithms import (
    InsufficientDataError,
    InvalidMaskError,
    NonFiniteInputError,
    ShapeMismatchError,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum_and_mean_by_hand() -> None:
    assert masked_sum(VALUES, MASK).item() == 7.0
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=-1), torch.tensor([1.5, 4.0]))
    torch.testing.assert_close(masked_sum(VALUES, MASK, dim=0), torch.tensor([5.0, 2.0, 0.0]))


def test_masked_mean_of_nothing_is_zero_like_verl_eps() -> None:
    empty = torch.zeros(2, 3)
    assert masked_mean(VALUES, empty).item() == 0.0
    per_row = masked_mean(VALUES, torch.tensor([[0, 0, 0], [1, 1, 0]]), dim=-1)
    torch.testing.assert_close(per_row, torch.tensor([0.0, 4.5]))


def test_masked_var_unbiased_by_default_and_biased_on_request() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0])
    assert masked_var(values, mask).item() == pytest.approx(1.0)  # Bessel: 2/3 * 3/2
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)


def test_masked_var_matches_torch_on_random_data() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=g, dtype=torch.float64)
    m = torch.rand(6, 9, generator=g) > 0.4
    torch.testing.assert_close(masked_var(x, m), x[m].var(unbiased=True))
    torch.testing.assert_close(masked_var(x, m, unbiased=False), x[m].var(unbiased=False))


def test_masked_var_raises_on_too_few_elements() -> None:
    one = torch.tensor([1, 0, 0, 0])
    with pytest.raises(InsufficientDataError):
        masked_var(torch.arange(4.0), one)
    assert masked_var(torch.arange(4.0), one, unbiased=False).item() == 0.0
    with pytest.raises(InsufficientDataError):
        masked_var(torch.arange(4.0), torch.zeros(4), unbiased=False)


def test_masked_whiten_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    scale = 1 / math.sqrt(1.0 + 1e-8)  # unbiased var of [1, 2, 3] is 1; eps inside the root
    expected = torch.tensor([[-scale, 0.0, scale, 0.0]])
    torch.testing.assert_close(masked_whiten(values, mask), expected)
    shifted = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(shifted, torch.tensor([[2 - scale, 2.0, 2 + scale, 0.0]]))


def test_whiten_eps_sits_inside_the_root() -> None:
    values = torch.tensor([0.0, 1e-4], dtype=torch.float64)  # unbiased var 5e-9, comparable to eps
    w = masked_whiten(values, torch.ones(2))
    expected = torch.tensor([-0.5e-4, 0.5e-4], dtype=torch.float64) / math.sqrt(5e-9 + 1e-8)
    torch.testing.assert_close(w, expected)


def test_whitened_values_have_zero_mean_unit_unbiased_var() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3 + 2
    m = torch.rand(5, 7, generator=g) > 0.3
    w = masked_whiten(x, m)
    assert abs(w[m].mean().item()) < 1e-12
    assert w[m].var(unbiased=True).item() == pytest.approx(1.0, rel=1e-6)
    assert torch.all(w[~m] == 0)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -1e30])
def test_padding_never_changes_a_statistic(garbage: float) -> None:
    dirty = torch.where(MASK.bool(), VALUES, torch.full_like(VALUES, garbage))
    for fn in (masked_sum, masked_mean):
        torch.testing.assert_close(fn(dirty, MASK), fn(VALUES, MASK))
    torch.testing.assert_close(masked_var(dirty, MASK), masked_var(VALUES, MASK))
    torch.testing.assert_close(masked_whiten(dirty, MASK), masked_whiten(VALUES, MASK))


def test_non_finite_real_value_is_a_typed_error() -> None:
    bad = VALUES.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(NonFiniteInputError, match="values"):
        masked_mean(bad, MASK)


def test_bad_mask_and_shape_are_typed_errors() -> None:
    with pytest.raises(InvalidMaskError):
        masked_mean(VALUES, MASK * 2)
    with pytest.raises(ShapeMismatchError):
        masked_mean(VALUES, MASK[:, :2])
    # a bool mask is accepted as is
    assert masked_mean(VALUES, MASK.bool()).item() == pytest.approx(7 / 3)
