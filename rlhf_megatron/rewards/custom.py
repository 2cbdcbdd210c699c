"""Custom batched reward functions named ``"path/to/file.py:function"`` (as in TRL and verl).

The function must have the batched signature

    fn(responses: list[str], answers: list[str], **extra) -> list[float]

for example TRL's ``accuracy_reward(completions, solution, **kwargs)``. ``extra`` holds per-batch
fields such as ``data_sources``; only the keywords the function accepts are passed (all of them
when it takes ``**kwargs``). Every failure — at load or at call — is a one-line
:class:`RewardError` naming the function.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys
import uuid
from collections.abc import Callable, Sequence
from numbers import Real
from pathlib import Path
from typing import Any, Protocol

from rlhf_megatron.rewards.errors import RewardError, one_line


class BatchRewardFn(Protocol):
    """A batched reward: one float per response, in order."""

    def __call__(self, responses: list[str], answers: list[str], **extra: Any) -> list[float]: ...


class CustomReward:
    """A user's batched reward function wrapped with checks on every call.

    Args:
        fn: the user's function.
        label: the ``"file.py:function"`` spec, used in error messages.
    """

    def __init__(self, fn: Callable[..., Any], label: str) -> None:
        self.fn = fn
        self.label = label
        self._accepts_all, self._keywords = _accepted_keywords(fn)

    def __call__(self, responses: list[str], answers: list[str], **extra: Any) -> list[float]:
        """The checked rewards; raises :class:`RewardError` when the function raises or returns
        the wrong length, a non-numeric or a non-finite value."""
        if not self._accepts_all:
            extra = {k: v for k, v in extra.items() if k in self._keywords}
        try:
            result = self.fn(responses, answers, **extra)
        except Exception as exc:  # any user error becomes one typed line
            raise RewardError(
                f"reward function {self.label} raised {type(exc).__name__}: {one_line(str(exc))}"
            ) from exc
        return self._check(result, len(responses))

    def _check(self, result: Any, expected: int) -> list[float]:
        if hasattr(result, "tolist"):  # a torch tensor or numpy array
            result = result.tolist()
        if not isinstance(result, Sequence) or isinstance(result, str | bytes):
            raise RewardError(
                f"reward function {self.label} returned {type(result).__name__}, "
                "expected a list of floats"
            )
        if len(result) != expected:
            raise RewardError(
                f"reward function {self.label} returned {len(result)} rewards "
                f"for {expected} responses"
            )
        rewards: list[float] = []
        for i, value in enumerate(result):
            if isinstance(value, bool) or not isinstance(value, Real):
                raise RewardError(
                    f"reward function {self.label} returned a non-numeric reward {value!r} "
                    f"({type(value).__name__}) at index {i}"
                )
            if not math.isfinite(value):
                raise RewardError(
                    f"reward function {self.label} returned a non-finite reward {value!r} "
                    f"at index {i}"
                )
            rewards.append(float(value))
        return rewards

    def __repr__(self) -> str:
        return f"CustomReward({self.label!r})"


def _accepted_keywords(fn: Callable[..., Any]) -> tuple[bool, frozenset[str]]:
    """(takes ``**kwargs``, names it accepts by keyword) for filtering ``extra``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass everything
        return True, frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True, frozenset()
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return False, frozenset(p.name for p in params if p.kind in keyword_kinds)


def load_custom_reward(spec: str) -> CustomReward:
    """Import ``function`` from ``path/to/file.py`` (``spec = "path/to/file.py:function"``).

    Raises :class:`RewardError` when the spec has no ``:function``, the file is missing or not a
    ``.py``, importing it fails, or the function is missing or not callable.
    """
    fn = load_from_file(spec, "custom reward", "function", RewardError)
    return CustomReward(fn, spec)


def load_from_file(spec: str, kind: str, member: str,
                   error: type[Exception] = RewardError) -> Any:
    """The callable ``name`` from ``path/to/file.py`` (``spec = "path/to/file.py:name"``).

    Shared by custom rewards (``kind="custom reward"``, ``member="function"``) and environments
    (``kind="environment"``, ``member="class"``). The file is loaded with
    ``importlib.util.spec_from_file_location`` under a unique module name, so two files with the
    same stem never collide. Every failure is one line of type ``error`` naming the spec.
    """
    path_text, sep, fn_name = spec.rpartition(":")
    if not sep or not path_text or not fn_name:
        raise error(f"{kind} {spec!r} must have the form 'path/to/file.py:{member}'")
    path = Path(path_text)
    if path.suffix != ".py":
        raise error(f"{kind} file {path_text!r} is not a .py file")
    if not path.is_file():
        raise error(f"{kind} file {path_text!r} does not exist")
    module_name = f"rlhf_megatron_{kind.replace(' ', '_')}_{path.stem}_{uuid.uuid4().hex}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{kind} file {path_text!r} cannot be imported")
    module = importlib.util.module_from_spec(module_spec)
    # Registered so that dataclasses and pickling inside the user's file work.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise error(
            f"importing {kind} file {path_text!r} raised {type(exc).__name__}: "
            f"{one_line(str(exc))}"
        ) from exc
    if not hasattr(module, fn_name):
        raise error(f"{kind} file {path_text!r} has no {member} {fn_name!r}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise error(f"{kind} {spec!r}: {fn_name!r} is not callable (type {type(fn).__name__})")
    return fn
