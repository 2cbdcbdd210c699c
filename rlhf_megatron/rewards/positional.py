"""Positional partial credit for multi-token answers (the long-response quickstart's reward).

    reward.custom_function: rlhf_megatron/rewards/positional.py:positional_match

The answer is a sequence of whitespace-separated words ("7 7 7 7 7 7 7 7"); the reward of a
response is the fraction of the answer's positions whose word the response has at the same
position (extra response words earn nothing). A tiny model gets partial credit from its first
steps, so a GRPO group almost always has reward variance, unlike exact match on a long answer.
"""

from __future__ import annotations

from typing import Any


def positional_score(response: str, answer: str) -> float:
    """Fraction in [0, 1] of `answer`'s words matched position by position in `response`."""
    want, got = str(answer).split(), response.split()
    if not want:
        return 0.0
    return sum(w == g for w, g in zip(want, got)) / len(want)


def positional_match(responses: list[str], answers: list[str], **_: Any) -> list[float]:
    """Batched form (rewards/custom.py signature): one positional_score per response."""
    return [positional_score(r, a) for r, a in zip(responses, answers, strict=True)]
