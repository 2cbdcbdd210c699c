"""The environment interface an episode runner drives (one instance per episode)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

Message = dict[str, str]
"""One chat message: ``{"role": "user"|"tool"|..., "content": "..."}``."""


class StepResult(NamedTuple):
    """What :meth:`Environment.step` returns; unpacks as ``(observations, reward, done)``.

    ``observations`` are the messages appended after the assistant's turn (empty when done),
    ``reward`` is the reward of this turn (``None`` = no reward for this turn; the episode's reward
    is the sum of the turns' rewards, 0 when none were given).
    """

    observations: list[Message]
    reward: float | None
    done: bool


@dataclass
class ToolCallStats:
    """Per-episode tool counters an environment keeps (read by the episode runner's metrics)."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    error_log: list[str] = field(default_factory=list)


class Environment:
    """Base class of multi-turn environments. Subclasses override :meth:`reset` and :meth:`step`.

    The runner creates one instance per episode (``cls(**env_kwargs)``), calls ``reset(sample)``
    once, then ``step(text)`` after every assistant turn until ``done``. ``step`` sees the
    assistant's text (decoded for the environment only: the trainer keeps vLLM's token ids).
    ``step`` may block (a tool call): the runner calls it off the generation thread.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.tool_stats = ToolCallStats()

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        """The opening messages of the episode for one dataset ``sample``."""
        raise NotImplementedError

    def step(self, assistant_turn: str) -> StepResult:
        """Observation messages, this turn's reward (or None) and whether the episode is over."""
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (temporary directories); called once when the episode ends."""
