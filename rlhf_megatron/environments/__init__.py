"""Multi-turn environments for agentic RL: the interface, the loader and built-in tasks.

An environment is a class with ``reset(sample) -> messages`` and
``step(assistant_turn) -> (observation messages, reward or None, done)``; it is named in the config
by ``"path/to/file.py:ClassName"`` (as custom rewards are) or by a built-in name. See
docs/ENVIRONMENTS.md.
"""

from rlhf_megatron.environments.base import Environment, StepResult, ToolCallStats
from rlhf_megatron.environments.loader import BUILTIN_ENVIRONMENTS, load_environment
from rlhf_megatron.environments.sandbox import PythonSandbox, SandboxLimits, ToolResult

__all__ = [
    "BUILTIN_ENVIRONMENTS", "Environment", "PythonSandbox", "SandboxLimits", "StepResult",
    "ToolCallStats", "ToolResult", "load_environment",
]
