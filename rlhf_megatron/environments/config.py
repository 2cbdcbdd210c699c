"""``environment:`` config section: which environment drives multi-turn episodes, and their limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.environments.loader import load_environment
from rlhf_megatron.errors import ConfigError


@dataclass
class EnvironmentConfig:
    """Multi-turn episodes (issue 15). Off (single-turn rollouts) while ``path`` is None."""

    path: str | None = None
    """A built-in name (``arithmetic_tool``) or ``"path/to/file.py:ClassName"``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class (``cls(**kwargs)`` per episode)."""
    max_turns: int = 4
    """Assistant turns per episode; an episode still running after them is truncated."""
    max_tokens_per_turn: int = 64
    """Generated tokens per assistant turn (vLLM max_tokens)."""
    max_tokens_per_episode: int = 256
    """All tokens after the opening prompt (assistant + observations); reaching it truncates."""
    tool_workers: int = 4
    """Threads that run environment steps (tool calls) beside generation."""
    def validate(self, train_cfg: Any = None) -> None:
        """Check the limits, that the environment class loads, and (given the whole TrainConfig)
        that the run uses what episodes support: no dynamic sampling, no reward model (one-line
        ConfigError)."""
        if self.path is not None and train_cfg is not None:
            if train_cfg.algorithm.dynamic_sampling.enabled:
                raise ConfigError("environment.path cannot be combined with "
                                  "algorithm.dynamic_sampling.enabled")
            if train_cfg.reward_model.path is not None:
                raise ConfigError("environment.path: the environment gives the rewards; unset "
                                  "reward_model.path")
        for name in ("max_turns", "max_tokens_per_turn", "max_tokens_per_episode", "tool_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"environment.{name}={value!r}: expected an integer >= 1")
        if self.max_tokens_per_turn > self.max_tokens_per_episode:
            raise ConfigError(
                f"environment.max_tokens_per_turn={self.max_tokens_per_turn} exceeds "
                f"environment.max_tokens_per_episode={self.max_tokens_per_episode}")
        if self.path is not None:
            load_environment(self.path)

    @property
    def enabled(self) -> bool:
        return self.path is not None
