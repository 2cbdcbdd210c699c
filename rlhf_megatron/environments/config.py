"""``environment:`` config section: which environment drives multi-turn episodes, and their limits."""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_megatron.environments.loader import load_agent, load_environment
from rlhf_megatron.errors import ConfigError


@dataclass
class AgentConfig:
    """An agent written outside the trainer (issue 27): ``async def agent(base_url, api_key,
    sample) -> float | None`` in ``path`` (``"file.py:function"``), driving its episode through the
    OpenAI-compatible endpoint (rollout/agent_endpoint.py). Off while ``path`` is None."""

    path: str | None = None
    """``"path/to/file.py:function"``: an ``async def`` called once per episode."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the function (``agent(base_url, api_key, sample, **kwargs)``)."""
    timeout_seconds: float = 120.0
    """An episode's wall-clock limit; an agent still running after it ends with reward 0."""
    host: str = "127.0.0.1"
    """The address the endpoint listens on (loopback by default)."""
    tool_parser: str | None = None
    """A vLLM tool parser name (``hermes``, ``qwen3_xml``, ...) for a chat template with a tool
    format; None: the tag format (``<python>code</python>`` for a tool ``python(code)``)."""
    processes: int = 0
    """0: agents run on an event loop in a thread of the rollout engine's process; N > 0: in N
    processes of their own, started once and kept for the run (rollout/agent_processes.py): the
    agents' CPU off the engine's GIL, and an agent that kills its interpreter ends only the
    episodes of its process."""

    def validate(self) -> None:
        if isinstance(self.timeout_seconds, bool) or not isinstance(
                self.timeout_seconds, (int, float)) or self.timeout_seconds <= 0:
            raise ConfigError(f"environment.agent.timeout_seconds={self.timeout_seconds!r}: "
                              "expected a number > 0")
        if isinstance(self.processes, bool) or not isinstance(self.processes, int) or \
                not 0 <= self.processes <= 64:
            raise ConfigError(f"environment.agent.processes={self.processes!r}: expected an "
                              "integer from 0 (a thread of the engine's process) to 64")
        if self.path is not None:
            load_agent(self.path)
        known = vllm_tool_parser_names() if self.tool_parser is not None else set()
        if known and self.tool_parser not in known:
            raise ConfigError(f"environment.agent.tool_parser={self.tool_parser!r}: not a vLLM "
                              f"tool parser (known: {', '.join(sorted(known))})")


def vllm_tool_parser_names() -> set[str]:
    """The tool parser names the installed vLLM registers, read from the source of
    ``vllm/tool_parsers/__init__.py`` (its ``_TOOL_PARSERS_TO_REGISTER`` table) without importing
    vLLM (~11 s on CPU); empty where vLLM or that table is absent, and the endpoint's own lookup
    (rollout/agent_tools.vllm_tool_parser) is then the check."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return set()
    source = Path(list(spec.submodule_search_locations)[0]) / "tool_parsers" / "__init__.py"
    if not source.is_file():
        return set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                isinstance(t, ast.Name) and t.id == "_TOOL_PARSERS_TO_REGISTER"
                for t in node.targets):
            return {k.value for k in node.value.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


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
    agent: AgentConfig = field(default_factory=AgentConfig)
    """An agent driving the episodes through the OpenAI-compatible endpoint instead of an
    environment class (``path``); the limits above apply to its sessions (a request is a turn)."""
    def validate(self, train_cfg: Any = None) -> None:
        """Check the limits, that the environment class loads, and (given the whole TrainConfig)
        that the run uses what episodes support: no dynamic sampling, no reward model (one-line
        ConfigError)."""
        if self.path is not None and self.agent.path is not None:
            raise ConfigError("environment.path and environment.agent.path both set: an episode "
                              "is driven by an environment class or by an agent, not both")
        if self.enabled and train_cfg is not None:
            if train_cfg.algorithm.dynamic_sampling.enabled:
                raise ConfigError(f"environment.{self._driver} cannot be combined with "
                                  "algorithm.dynamic_sampling.enabled")
            if train_cfg.reward_model.path is not None:
                raise ConfigError(f"environment.{self._driver}: the {self._driver_kind} gives "
                                  "the rewards; unset reward_model.path")
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
        self.agent.validate()

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.agent.path is not None

    @property
    def _driver(self) -> str:
        return "path" if self.path is not None else "agent.path"

    @property
    def _driver_kind(self) -> str:
        return "environment" if self.path is not None else "agent"
