"""Typed errors for users. Each carries a one-line message that names the offending values.
Also `say`, the one-line notices a run prints for its user."""

import sys


class RlhfMegatronError(Exception):
    """Base class of every error this package raises for bad user input."""


class ConfigError(RlhfMegatronError, ValueError):
    """A configuration value is invalid; the message names the field, the value and what is valid."""


class LayoutError(ConfigError):
    """A parallel layout (TP/PP/VPP/CP/EP/DP) does not fit the world size, the model or the device."""


class UnsupportedArchitectureError(ConfigError):
    """The HF `architectures` field names a model this package has no registry entry for."""


class CheckpointError(RlhfMegatronError):
    """A checkpoint is missing, corrupt or does not match its config (the message names which)."""


class WorkerFailure(RlhfMegatronError):
    """A Ray worker died or raised during a step; the message names the worker and the call."""


def say(message: str) -> None:
    """One line for the user on stderr (warnings, progress the log should keep)."""
    print(f"[rlhf_megatron] {message}", file=sys.stderr, flush=True)
