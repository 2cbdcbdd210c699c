"""Load an environment class named ``"path/to/file.py:ClassName"`` or a built-in name.

Reuses the custom-reward loader (rewards/custom.py ``load_from_file``), so both give the same
one-line :class:`EnvironmentLoadError` messages, and the CLI maps them to exit status 2.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from rlhf_megatron.environments.arithmetic import ArithmeticToolEnv
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.rewards.custom import load_from_file


class EnvironmentLoadError(ConfigError):
    """An environment spec cannot be loaded (one-line message naming the spec)."""


class AgentLoadError(ConfigError):
    """An agent spec cannot be loaded (one-line message naming the spec)."""


def _builtin_arithmetic() -> type:

    return ArithmeticToolEnv


BUILTIN_ENVIRONMENTS = {"arithmetic_tool": _builtin_arithmetic}


def load_environment(spec: str) -> type:
    """The environment class for ``spec`` (a built-in name or ``"path/to/file.py:ClassName"``).

    Raises :class:`EnvironmentLoadError` (a ConfigError) with one line when the spec is malformed,
    the file is missing, importing it fails, or the name is missing, not a class, or has no
    ``reset``/``step``.
    """
    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec]()
    cls = load_from_file(spec, "environment", "class", EnvironmentLoadError)
    if not isinstance(cls, type):
        raise EnvironmentLoadError(
            f"environment {spec!r}: {spec.rpartition(':')[2]!r} is not a class "
            f"(type {type(cls).__name__})"
        )
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvironmentLoadError(
            f"environment {spec!r}: class has no {' or '.join(missing)} method"
        )
    return cls


def load_agent(spec: str) -> Callable:
    """The agent function for ``spec`` (``"path/to/file.py:function"``, an ``async def``).

    Raises :class:`AgentLoadError` (a ConfigError) with one line when the spec is malformed, the
    file is missing or fails to import, or the name is missing or not an ``async def``.
    """
    fn = load_from_file(spec, "agent", "function", AgentLoadError)
    if not inspect.iscoroutinefunction(fn):
        raise AgentLoadError(f"agent {spec!r}: {spec.rpartition(':')[2]!r} is not an async "
                             "function (write it as `async def`)")
    return fn
