"""Typed errors raised by :mod:`rlhf_megatron.algorithms`.

Every user-facing failure of this package is an :class:`AlgorithmError` with a one-line message;
``assert`` is kept for internal invariants only. The subclasses also derive from the builtin
exception a caller would naturally catch (``ValueError``, ``KeyError``), so generic handlers keep
working.
"""

from __future__ import annotations

from collections.abc import Iterable


class AlgorithmError(Exception):
    """Base class of every error raised by the algorithms package."""


class UnknownNameError(AlgorithmError, KeyError, ValueError):
    """A registry was asked for a name it does not hold; the message lists the known names."""

    def __init__(self, kind: str, name: str, known: Iterable[str]) -> None:
        self.kind = kind
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would otherwise wrap the message in quotes
        return str(self.args[0])


class DuplicateNameError(AlgorithmError, ValueError):
    """A second, different function was registered under a name that is already taken."""


class ShapeMismatchError(AlgorithmError, ValueError):
    """Input tensors do not have the documented shapes."""


class InvalidMaskError(AlgorithmError, ValueError):
    """A response mask holds values other than 0 and 1."""


class NonFiniteInputError(AlgorithmError, ValueError):
    """An input holds NaN or +-inf at a real (mask == 1) position."""


class MissingInputError(AlgorithmError, ValueError):
    """An optional input that the chosen estimator or loss needs was not given."""


class InvalidConfigError(AlgorithmError, ValueError):
    """A hyperparameter is out of its valid range."""


class InsufficientDataError(AlgorithmError, ValueError):
    """A statistic was asked of too few real elements (e.g. unbiased variance of one element)."""
