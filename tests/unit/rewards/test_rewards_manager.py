"""RewardManager: batch shape/dtype, routing by data_source, custom functions, async."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_megatron.rewards import RewardConfig, RewardError, RewardManager

RESPONSES = ["... #### 1,000", "so \\boxed{\\frac{1}{2}}", "it is 7", "Paris"]
ANSWERS = ["#### 1000", "0.5", "7", "paris"]
SOURCES = ["openai/gsm8k", "math", "other", "trivia"]


def _manager(**kwargs: object) -> RewardManager:
    return RewardManager(RewardConfig(**kwargs))  # type: ignore[arg-type]


def test_default_rule_shape_and_dtype() -> None:
    rewards = _manager().compute(RESPONSES, ANSWERS)
    assert rewards.shape == (4,) and rewards.dtype == torch.float32
    # math_numeric: markers, then the last number; "Paris" has none.
    assert rewards.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_routing_by_data_source() -> None:
    rm = _manager(
        reward_name="math_numeric_strict",
        by_data_source={"openai/gsm8k": "gsm8k", "math": "boxed", "trivia": "exact_match_ci"},
    )
    assert rm.compute(RESPONSES, ANSWERS, SOURCES).tolist() == [1.0, 1.0, 0.0, 1.0]
    # Without data sources every sample takes the default rule.
    assert rm.compute(RESPONSES, ANSWERS).tolist() == [1.0, 1.0, 0.0, 0.0]


def test_format_score() -> None:
    rm = _manager(reward_name="gsm8k", format_score=0.1)
    assert rm.compute(["#### 3", "#### 4", "4"], ["4", "4", "4"]).tolist() == pytest.approx(
        [0.1, 1.0, 0.0]
    )


def test_empty_batch() -> None:
    rewards = _manager().compute([], [])
    assert rewards.shape == (0,) and rewards.dtype == torch.float32


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(RewardError, match=r"unknown reward 'gsm9k'; known rewards: boxed, "):
        _manager(by_data_source={"a": "gsm9k"})
    with pytest.raises(RewardError, match="max_workers must be >= 1, got 0"):
        _manager(max_workers=0)


def test_length_mismatch() -> None:
    rm = _manager()
    with pytest.raises(RewardError, match="got 1 answers for 2 responses"):
        rm.compute(["a", "b"], ["a"])
    with pytest.raises(RewardError, match="got 1 data_sources for 2 responses"):
        rm.compute(["a", "b"], ["a", "b"], ["x"])


def test_custom_function(tmp_path: Path) -> None:
    path = tmp_path / "r.py"
    path.write_text(
        "def f(responses, answers, data_sources=None, **kw):\n"
        "    return [0.5 if s == 'x' else -1 for s in data_sources]\n"
    )
    rm = _manager(custom_function=f"{path}:f")
    rewards = rm.compute(["a", "b"], ["a", "b"], ["x", "y"])
    assert rewards.dtype == torch.float32 and rewards.tolist() == [0.5, -1.0]


def test_compute_async_equals_compute() -> None:
    with _manager(by_data_source={"trivia": "exact_match_ci"}) as rm:
        expected = rm.compute(RESPONSES, ANSWERS, SOURCES)
        responses = list(RESPONSES)
        future = rm.compute_async(responses, ANSWERS, SOURCES)
        responses.clear()  # the manager copied the inputs
        assert torch.equal(future.result(timeout=10), expected)
    assert rm._pool is None  # closed by the context manager


def test_compute_async_raises_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "r.py"
    path.write_text("def f(r, a):\n    raise KeyError('k')\n")
    with _manager(custom_function=f"{path}:f") as rm:
        with pytest.raises(RewardError, match="raised KeyError"):
            rm.compute_async(["a"], ["a"]).result(timeout=10)
