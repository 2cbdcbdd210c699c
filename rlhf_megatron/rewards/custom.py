"""Custom reward functions named ``"path/to/file.py:function"`` (as in TRL and verl).

Two signatures are accepted, told apart by the parameter names:

    fn(responses: list[str], answers: list, **extra) -> list[float | dict]     # batched (TRL's)
    fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict   # verl's, per sample

A function with a ``solution_str`` parameter is verl's: it is called once per response, with
keywords, as verl's reward manager calls it. A batched one gets per-batch fields in ``extra``
(``data_sources``, ``extra_infos``): only the keywords it accepts are passed (all of them when it
takes ``**kwargs``). Either may be ``async def`` (a verl function's samples are then awaited
together). A reward is a number, or a dict whose ``score`` is the reward and whose other numeric
keys are logged as ``reward/<key>`` means (verl's convention). Every failure, at load or at call,
is a one-line :class:`RewardError` naming the function.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any, Protocol

from rlhf_megatron.rewards.errors import RewardError, one_line


class BatchRewardFn(Protocol):
    """A batched reward: one float (or dict with ``score``) per response, in order."""

    def __call__(self, responses: list[str], answers: list[Any], **extra: Any) -> list[Any]: ...


VERL_MARKER = "solution_str"
"""The parameter that makes a function verl's per-sample ``compute_score``."""


@dataclass
class Scored:
    """A batch's rewards, and the means of the extra numeric keys the function returned."""

    rewards: list[float]
    metrics: dict[str, float] = field(default_factory=dict)


class CustomReward:
    """A user's reward function (either signature, module docstring) wrapped with checks on
    every call.

    Args:
        fn: the user's function.
        label: the ``"file.py:function"`` spec, used in error messages.
    """

    def __init__(self, fn: Callable[..., Any], label: str) -> None:
        self.fn = fn
        self.label = label
        self._accepts_all, self._keywords = _accepted_keywords(fn)
        self.per_sample = VERL_MARKER in self._keywords
        self.is_async = inspect.iscoroutinefunction(fn)

    def __call__(self, responses: list[str], answers: list[Any], **extra: Any) -> list[float]:
        """The checked rewards (see :meth:`score`)."""
        return self.score(responses, answers, **extra).rewards

    def score(self, responses: list[str], answers: list[Any], **extra: Any) -> Scored:
        """The checked rewards and metrics; raises :class:`RewardError` when the function raises
        or returns the wrong length, a non-numeric or a non-finite value."""
        try:
            result = self._run(responses, answers, extra)
        except Exception as exc:  # any user error becomes one typed line
            raise RewardError(
                f"reward function {self.label} raised {type(exc).__name__}: {one_line(str(exc))}"
            ) from exc
        return self._check(result, len(responses))

    def _run(self, responses: list[str], answers: list[Any], extra: dict[str, Any]) -> Any:
        if not self.per_sample:
            if not self._accepts_all:
                extra = {k: v for k, v in extra.items() if k in self._keywords}
            result = self.fn(responses, answers, **extra)
            return asyncio.run(result) if self.is_async else result
        sources = extra.get("data_sources") or [None] * len(responses)
        infos = extra.get("extra_infos") or [None] * len(responses)
        calls = [self._verl_kwargs(source, response, answer, info) for source, response, answer,
                 info in zip(sources, responses, answers, infos, strict=True)]
        if self.is_async:
            return asyncio.run(_gather(self.fn, calls))
        return [self.fn(**kwargs) for kwargs in calls]

    def _verl_kwargs(self, source: Any, response: str, answer: Any, info: Any) -> dict[str, Any]:
        kwargs = {"data_source": source, "solution_str": response, "ground_truth": answer,
                  "extra_info": info}
        if self._accepts_all:
            return kwargs
        return {k: v for k, v in kwargs.items() if k in self._keywords}

    def _check(self, result: Any, expected: int) -> Scored:
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
        extras: dict[str, list[float]] = {}
        for i, value in enumerate(result):
            if isinstance(value, Mapping):
                if "score" not in value:
                    raise RewardError(
                        f"reward function {self.label} returned a dict without 'score' at index "
                        f"{i} (keys: {sorted(value)})")
                for key, item in value.items():
                    if key != "score" and _is_number(item):
                        extras.setdefault(key, []).append(float(item))
                value = value["score"]
            if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
                value = value.item()
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
        metrics = {f"reward/{key}": sum(v) / len(v) for key, v in extras.items()}
        return Scored(rewards, metrics)

    def __repr__(self) -> str:
        return f"CustomReward({self.label!r})"


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and math.isfinite(value)


async def _gather(fn: Callable[..., Any], calls: list[dict[str, Any]]) -> list[Any]:
    return list(await asyncio.gather(*(fn(**kwargs) for kwargs in calls)))


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
