"""Typed errors of the reward package."""

from __future__ import annotations

from rlhf_megatron.errors import ConfigError


class RewardError(ConfigError):
    """A reward name, custom reward function or its result is invalid (one-line message)."""


def one_line(text: str) -> str:
    """``text`` with newlines collapsed to spaces, so error messages stay on one line."""
    return " ".join(text.split())
