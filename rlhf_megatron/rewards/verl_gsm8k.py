"""A GSM8K reward written as a verl user writes one, with verl's per-sample signature and no
import of this package: `reward.custom_function: <this file>:compute_score` (configs/
verl_gsm8k_*.yaml) takes it unchanged, as it would take the user's own file.

The scoring follows verl's documented GSM8K rule (verl/utils/reward_score/gsm8k.py): the answer
is the number after "####" ("strict"); without one, the last number in the response
("flexible", which verl offers as `method="flexible"`, and which the CPU quickstart's one-token
answers need). Score 1 for the right number, 0 otherwise. The returned dict carries the score and
the fraction of responses in the strict format, which the trainer logs as reward/strict_format.
"""

from __future__ import annotations

import re

_STRICT = re.compile(r"####\s*(-?[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?[0-9][0-9.,]*")


def _number(text: str) -> str:
    """'1,234.' -> '1234': thousands separators and a trailing full stop dropped."""
    return text.replace(",", "").rstrip(".")


def extract_answer(solution_str: str) -> tuple[str | None, bool]:
    """(the answer's number or None, whether it came in the strict '#### N' format)."""
    strict = _STRICT.findall(solution_str)
    if strict:
        return _number(strict[-1]), True
    numbers = [_number(n) for n in _NUMBER.findall(solution_str)]
    numbers = [n for n in numbers if n not in ("", "-")]
    return (numbers[-1] if numbers else None), False


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's reward signature: one response, its ground truth, the row's data_source and
    extra_info. Returns {"score": 1.0 or 0.0, "strict_format": 1.0 or 0.0}."""
    answer, strict = extract_answer(solution_str)
    right = answer is not None and answer == _number(str(ground_truth).strip())
    return {"score": 1.0 if right else 0.0, "strict_format": 1.0 if strict else 0.0}
