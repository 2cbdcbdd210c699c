"""Answer extraction, comparison and the rule-reward registry, on hand examples."""

from __future__ import annotations

import pytest

from rlhf_megatron.rewards import (
    RULE_REWARDS,
    RewardError,
    answers_match,
    compute_exact_match,
    compute_numeric_match,
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    extract_last_number,
    get_rule_reward,
    parse_ground_truth,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
        ("#### 5\nwait, recount\n#### 6", "6"),  # the last marker wins
        ("#### $1,000.", "1,000"),
        ("####-2", "-2"),
        ("#### 3.50 dollars", "3.50"),
        ("#### x+1", "x+1"),  # no number on the line: its text
        ("####   \n", None),
        ("the answer is 7", None),
    ],
)
def test_extract_gsm8k(text: str, expected: str | None) -> None:
    assert extract_gsm8k(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\sqrt{\\frac{a}{b^{2}}}}", "\\sqrt{\\frac{a}{b^{2}}}"),
        ("first \\boxed{1} then \\boxed{ 2 }", "2"),  # the last box wins, stripped
        ("\\boxed{unclosed {", None),
        ("\\boxed{}", None),
        ("no box 5", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I had 3 then 1,000 apples.", "1,000"),
        ("temperature fell to -2.5 today", "-2.5"),
        ("a, b and 12, 13", "13"),
        ("about .5 of it", ".5"),
        ("no digits here", None),
    ],
)
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


def test_extract_answer_styles_and_strict_flag() -> None:
    text = "\\boxed{3} and later #### 4"
    assert extract_answer(text, style="any") == "4"  # the later marker wins
    assert extract_answer("#### 4 then \\boxed{3}", style="any") == "3"
    assert extract_answer(text, style="boxed") == "3"
    assert extract_answer(text, style="gsm8k") == "4"
    assert extract_answer("it is 9.", style="any", strict=True) is None
    assert extract_answer("it is 9.", style="any", strict=False) == "9"
    with pytest.raises(ValueError, match="style"):
        extract_answer("x", style="latex")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        (" 72 ", "72"),
        (72, "72"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ],
)
def test_parse_ground_truth(answer: object, expected: str) -> None:
    assert parse_ground_truth(answer) == expected


@pytest.mark.parametrize(
    ("predicted", "reference", "expected"),
    [
        ("1,000", "1000", True),
        ("3.0", "3", True),
        ("-2", "-2.00", True),
        ("-2", "2", False),
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{1}{2}", "1/2", True),
        ("\\frac{1}{2}", "\\frac {1}{2}", True),
        ("$5", "5", True),
        ("x + 1", "x+1", True),
        ("\\sqrt{2}", "\\sqrt{3}", False),
        ("1,0000", "10000", False),  # not a thousands grouping: compared as text
    ],
)
def test_answers_match(predicted: str, reference: str, expected: bool) -> None:
    assert answers_match(predicted, reference) is expected


def test_numeric_match_rewards_and_format_score() -> None:
    assert compute_numeric_match("... #### 1,000", "1000") == 1.0
    assert compute_numeric_match("... #### 999", "#### 1000") == 0.0
    assert compute_numeric_match("... #### 999", "1000", format_score=0.1) == pytest.approx(0.1)
    assert compute_numeric_match("no answer", "1000", format_score=0.1) == 0.0
    assert compute_numeric_match("so 1000", "1000") == 0.0  # strict by default
    assert compute_numeric_match("so 1000", "1000", strict=False) == 1.0


def test_registered_rules() -> None:
    assert get_rule_reward("gsm8k")("#### 42", "42") == 1.0
    assert get_rule_reward("gsm8k")("\\boxed{42}", "42") == 0.0
    assert get_rule_reward("boxed")("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert get_rule_reward("math_numeric")("the total is 42.", "#### 42") == 1.0
    assert get_rule_reward("math_numeric_strict")("the total is 42.", "42") == 0.0
    assert get_rule_reward("exact_match")(" Paris \n", "Paris") == 1.0
    assert get_rule_reward("exact_match")("paris", "Paris") == 0.0
    assert get_rule_reward("exact_match_ci")("paris", "PARIS") == 1.0
    assert set(RULE_REWARDS) >= {"gsm8k", "boxed", "math_numeric", "exact_match"}


def test_exact_match_format_score() -> None:
    assert compute_exact_match("Lyon", "Paris", format_score=0.2) == pytest.approx(0.2)
    assert compute_exact_match("   ", "Paris", format_score=0.2) == 0.0


def test_unknown_rule_name_lists_known_names() -> None:
    with pytest.raises(RewardError) as info:
        get_rule_reward("gsm9k")
    message = str(info.value)
    assert "\n" not in message
    assert "'gsm9k'" in message
    assert "boxed, exact_match, exact_match_ci, gsm8k, math_numeric" in message
