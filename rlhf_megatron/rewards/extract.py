"""Answer extraction and comparison for rule rewards (pure Python, no torch).

Three ways to find the final answer in a model response:

* GSM8K style: the text after the *last* ``####`` marker (``"... #### 42"`` -> ``"42"``).
* LaTeX style: the contents of the *last* ``\\boxed{...}``, braces balanced
  (``"\\boxed{\\frac{1}{2}}"`` -> ``"\\frac{1}{2}"``).
* Fallback: the last number anywhere in the text (``"so 1,000 apples."`` -> ``"1,000"``).

Two answers match when both parse as numbers and are equal exactly (``"1,000" == "1000"``,
``"3.0" == "3"``, ``"\\frac{1}{2}" == "0.5"``), or else when their normalised texts are equal.
"""

from __future__ import annotations

import re
from fractions import Fraction

GSM8K_MARKER = "####"
_BOXED = "\\boxed"
# A number with optional sign, thousands commas and decimals: "-1,234.5", "3", ".5".
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_FRAC_RE = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(\d+)\}$")
# LaTeX decorations that never change the value of an answer.
_TEXT_STRIP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", "\\%", "%")


def extract_gsm8k(text: str) -> str | None:
    """The answer after the last ``####`` marker, or None when there is none.

    A number opening the marker's line is returned alone (``"#### $1,000."`` -> ``"1,000"``);
    otherwise the line's stripped text (``"#### x+1"`` -> ``"x+1"``; None when empty).
    """
    pos = text.rfind(GSM8K_MARKER)
    if pos < 0:
        return None
    rest = text[pos + len(GSM8K_MARKER) :].split("\n", 1)[0].strip()
    match = _NUMBER_RE.match(rest.lstrip("$ "))
    if match is not None:
        return match.group(0)
    return rest.rstrip(".").strip() or None


def extract_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (nested braces balanced), or None.

    An unclosed last box yields None rather than a guess.
    """
    pos = text.rfind(_BOXED + "{")
    if pos < 0:
        return None
    start = pos + len(_BOXED) + 1
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip() or None
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (sign, thousands commas and decimals kept), or None."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str, *, style: str = "any", strict: bool = True) -> str | None:
    """The final answer of ``text``.

    Args:
        style: ``"gsm8k"`` (``####`` only), ``"boxed"`` (``\\boxed{}`` only) or ``"any"`` (whichever
            marker comes last in the text).
        strict: True -> only the markers count; False -> fall back to the last number in the text.
    """
    found: str | None = None
    if style == "gsm8k":
        found = extract_gsm8k(text)
    elif style == "boxed":
        found = extract_boxed(text)
    elif style == "any":
        # Whichever marker appears later is the model's final word.
        if text.rfind(GSM8K_MARKER) > text.rfind(_BOXED + "{"):
            found = extract_gsm8k(text)
        else:
            found = extract_boxed(text)
    else:
        raise ValueError(f"style must be 'gsm8k', 'boxed' or 'any', got {style!r}")
    if found is None and not strict:
        found = extract_last_number(text)
    return found


def parse_ground_truth(answer: object) -> str:
    """The reference answer as text: a ``"... #### n"`` solution -> ``"n"``; a ``\\boxed{}``
    solution -> its contents; a bare string or number -> itself, stripped."""
    text = str(answer)
    if GSM8K_MARKER in text:
        return extract_gsm8k(text) or ""
    if _BOXED + "{" in text:
        return extract_boxed(text) or ""
    return text.strip()


def normalize_text(text: str) -> str:
    """Text form for comparison: no whitespace or LaTeX sizing/dollar/percent decorations,
    ``\\dfrac``/``\\tfrac`` -> ``\\frac``, no trailing period."""
    out = "".join(text.split())
    for token in _TEXT_STRIP:
        out = out.replace(token, "")
    out = out.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return out.rstrip(".")


def to_number(text: str) -> Fraction | None:
    """The exact value of ``text`` if it is a plain number, integer fraction or ``\\frac{a}{b}``.

    ``"1,000"`` -> 1000, ``"3.0"`` -> 3, ``"-2"`` -> -2, ``"1/2"`` and ``"\\frac{1}{2}"`` -> 1/2;
    anything else (``"x+1"``, ``"inf"``) -> None.
    """
    norm = normalize_text(text)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", norm):
        norm = norm.replace(",", "")
    frac = _FRAC_RE.match(norm)
    if frac is not None:
        norm = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    try:
        return Fraction(norm)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, reference: str) -> bool:
    """Numeric equality when both sides are numbers, else equality of the normalised texts."""
    pred_num, ref_num = to_number(predicted), to_number(reference)
    if pred_num is not None and ref_num is not None:
        return pred_num == ref_num
    return normalize_text(predicted) == normalize_text(reference)
