"""Rule rewards and their registry.

Every rule reward has one signature, ``fn(response, answer, *, format_score=0.0) -> float``:
1.0 when the response's final answer matches ``answer``, ``format_score`` when an answer was
found but is wrong, 0.0 when none was found. Look one up with :func:`get_rule_reward`; an unknown
name raises :class:`RewardError` listing the known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from rlhf_megatron.rewards.errors import RewardError
from rlhf_megatron.rewards.extract import answers_match, extract_answer, parse_ground_truth


class RuleReward(Protocol):
    """A per-sample rule reward: ``(response, answer, *, format_score) -> float``."""

    def __call__(self, response: str, answer: str, *, format_score: float = 0.0) -> float: ...


def compute_numeric_match(
    response: str,
    answer: str,
    *,
    style: str = "any",
    strict: bool = True,
    format_score: float = 0.0,
) -> float:
    """1.0 if the final answer of ``response`` equals ``answer`` (numerically where both are
    numbers), ``format_score`` if an answer was found but differs, else 0.0.

    Args:
        style: where the answer is marked: ``"gsm8k"`` (``#### n``), ``"boxed"`` or ``"any"``.
        strict: True -> only the markers count; False -> fall back to the last number in the text.
        answer: the reference, bare (``"42"``) or as a GSM8K solution (``"... #### 42"``).
    """
    predicted = extract_answer(response, style=style, strict=strict)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, parse_ground_truth(answer)) else float(format_score)


def compute_exact_match(
    response: str,
    answer: str,
    *,
    case_insensitive: bool = False,
    format_score: float = 0.0,
) -> float:
    """1.0 if ``response`` equals ``answer`` after strip (and casefold when
    ``case_insensitive``); ``format_score`` for any other non-empty response; 0.0 when empty."""
    got, want = response.strip(), str(answer).strip()
    if case_insensitive:
        got, want = got.casefold(), want.casefold()
    if got == want:
        return 1.0
    return float(format_score) if got else 0.0


def gsm8k_reward(response: str, answer: str, *, format_score: float = 0.0) -> float:
    """Numeric match of the answer after the last ``####`` (strict: no fallback)."""
    return compute_numeric_match(response, answer, style="gsm8k", format_score=format_score)


def boxed_reward(response: str, answer: str, *, format_score: float = 0.0) -> float:
    """Match of the last ``\\boxed{...}`` (strict: no fallback)."""
    return compute_numeric_match(response, answer, style="boxed", format_score=format_score)


def math_numeric_reward(response: str, answer: str, *, format_score: float = 0.0) -> float:
    """Match of the last ``####`` or ``\\boxed{}`` answer, else of the last number in the text."""
    return compute_numeric_match(
        response, answer, style="any", strict=False, format_score=format_score
    )


def math_numeric_strict_reward(response: str, answer: str, *, format_score: float = 0.0) -> float:
    """Match of the last ``####`` or ``\\boxed{}`` answer; no answer marker -> 0.0."""
    return compute_numeric_match(
        response, answer, style="any", strict=True, format_score=format_score
    )


def exact_match_reward(response: str, answer: str, *, format_score: float = 0.0) -> float:
    """Exact match after strip, case-sensitive."""
    return compute_exact_match(response, answer, format_score=format_score)


def exact_match_ci_reward(response: str, answer: str, *, format_score: float = 0.0) -> float:
    """Exact match after strip, case-insensitive."""
    return compute_exact_match(response, answer, case_insensitive=True, format_score=format_score)


# Read-only: the table is fixed at import; add a rule by adding a function and a row here.
RULE_REWARDS: Mapping[str, RuleReward] = MappingProxyType(
    {
        "gsm8k": gsm8k_reward,
        "boxed": boxed_reward,
        "math_numeric": math_numeric_reward,
        "math_numeric_strict": math_numeric_strict_reward,
        "exact_match": exact_match_reward,
        "exact_match_ci": exact_match_ci_reward,
    }
)


def get_rule_reward(name: str) -> RuleReward:
    """The rule reward registered as ``name``; unknown -> :class:`RewardError` listing the known."""
    try:
        return RULE_REWARDS[name]
    except KeyError:
        known = ", ".join(sorted(RULE_REWARDS))
        raise RewardError(f"unknown reward {name!r}; known rewards: {known}") from None
