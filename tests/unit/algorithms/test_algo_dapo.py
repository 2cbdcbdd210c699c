"""DAPO: overlong reward shaping and the dynamic-sampling group filter, by hand."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.algorithms import (
    DynamicSamplingConfig,
    InvalidConfigError,
    OverlongShapingConfig,
    ShapeMismatchError,
    informative_groups,
    overlong_penalty,
    shape_overlong,
)


def test_overlong_penalty_by_hand() -> None:
    """max 20, buffer 4: free up to 16 tokens, then linear to the full penalty at 20."""
    lengths = torch.tensor([3, 16, 17, 18, 20, 25])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4),
                               torch.tensor([0.0, 0.0, 0.25, 0.5, 1.0, 1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, penalty=0.5)[3], torch.tensor(0.25))


def test_shape_overlong_subtracts_the_penalty_and_reports_it() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    lengths = torch.tensor([10, 19, 20, 5])
    shaped, metrics = shape_overlong(scores, lengths, OverlongShapingConfig(buffer=4), 20)
    torch.testing.assert_close(shaped, torch.tensor([1.0, 0.25, -1.0, 0.0]))
    assert metrics == {"reward/overlong_penalty": pytest.approx((0.75 + 1.0) / 4),
                       "reward/overlong_frac": 0.5}
    explicit = OverlongShapingConfig(buffer=2, max_length=10)  # overrides the sampling length
    # max 10, buffer 2: 10, 19 and 20 tokens pay the full penalty, 5 tokens nothing
    torch.testing.assert_close(shape_overlong(scores, lengths, explicit, 20)[0],
                               torch.tensor([0.0, 0.0, -1.0, 0.0]))
    off, none = shape_overlong(scores, lengths, OverlongShapingConfig(), 20)
    assert off is scores and none == {}


def test_informative_groups_drop_all_equal_groups_and_keep_singletons() -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3])
    assert informative_groups(scores, groups).tolist() == [True, True, False, False, True,
                                                           False, False]
    with pytest.raises(ShapeMismatchError):
        informative_groups(scores, groups[:3])


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: DynamicSamplingConfig(max_rounds=0), "max_rounds"),
        (lambda: DynamicSamplingConfig(max_rounds=1.5), "max_rounds"),
        (lambda: OverlongShapingConfig(buffer=-1), "buffer"),
        (lambda: OverlongShapingConfig(buffer=4, penalty=-1.0), "penalty"),
        (lambda: OverlongShapingConfig(buffer=8, max_length=4), "exceed"),
    ],
)
def test_bad_dapo_config_is_one_line(build, match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match) as info:
        build()
    assert "\n" not in str(info.value)
