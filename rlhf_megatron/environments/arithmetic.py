"""Multi-step arithmetic with a Python tool: products of 3-4 digit numbers the tiny model cannot
do in its head, so the reward needs a tool call.

Protocol (tag format, for models without a tool-calling chat template; docs/ENVIRONMENTS.md):
- the assistant runs code with ``<python>print(...)</python>``; the environment answers with a
  ``tool`` message whose content is the output (rendered as ``<output>...</output>`` by the
  fallback chat format); models whose chat template has a tool format may instead emit
  ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`` (Qwen/Hermes style);
- the assistant ends the episode with ``<answer>N</answer>``: reward 1 when N is right, else 0;
- a turn with neither ends the episode with reward 0.
A failing tool call (exception, refused operation, CPU/wall timeout, output flood) does not end the
episode: its one-line error is the observation, it is logged and counted in ``tool_stats``; the
episode's reward stays 0 unless a later turn answers correctly. ``tool_bonus`` (default 0) adds a
reward for the first successful tool call, to shape a tiny model towards using the tool.
"""

from __future__ import annotations

import json
import logging
import random
import re
from typing import Any

from rlhf_megatron.environments.base import Environment, Message, StepResult
from rlhf_megatron.environments.sandbox import PythonSandbox, SandboxLimits

log = logging.getLogger(__name__)

_PYTHON = re.compile(r"<python>(.*?)</python>", re.S)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>", re.S)

SYSTEM_PROMPT = (
    "Solve the arithmetic problem. Run Python with <python>print(expression)</python>; "
    "you will see its output. Then reply with <answer>NUMBER</answer>."
)


def make_arithmetic_samples(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` samples ``{"prompt": question, "answer": "N"}``: a*b + c with 3-4 digit numbers."""
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        a, b, c = rng.randint(100, 9999), rng.randint(100, 999), rng.randint(10, 999)
        samples.append({"prompt": f"What is {a} * {b} + {c}?", "answer": str(a * b + c)})
    return samples


def extract_code(text: str) -> str | None:
    """The code of the first tool call in ``text`` (tag or JSON tool-call format), else None."""
    match = _PYTHON.search(text)
    if match:
        return match.group(1).strip()
    match = _TOOL_CALL.search(text)
    if match:
        try:
            call = json.loads(match.group(1))
            args = call.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if call.get("name") == "python" and isinstance(args.get("code"), str):
                return args["code"]
        except (json.JSONDecodeError, AttributeError):
            return "raise SyntaxError('malformed tool call JSON')"
    return None


class ArithmeticToolEnv(Environment):
    """The built-in ``arithmetic_tool`` environment (see the module docstring for the protocol).

    Args:
        limits: the Python tool's limits (dict of SandboxLimits fields or the dataclass).
        tool_bonus: reward added once for the first successful tool call.
        system_prompt: the opening system message (the protocol in words); None or "" for none
            (the tools quickstart's word-level tokenizer has no English words).
    """

    def __init__(self, limits: SandboxLimits | dict[str, Any] | None = None,
                 tool_bonus: float = 0.0, system_prompt: str | None = SYSTEM_PROMPT,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(limits, dict):
            limits = SandboxLimits(**limits)
        self.limits = limits or SandboxLimits()
        self.tool_bonus = float(tool_bonus)
        self.system_prompt = system_prompt
        self.answer: str | None = None
        self._sandbox: PythonSandbox | None = None
        self._bonus_paid = False

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        self.answer = str(sample["answer"]).strip()
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": str(sample["prompt"])}]

    def step(self, assistant_turn: str) -> StepResult:
        answer = _ANSWER.search(assistant_turn)
        code = extract_code(assistant_turn)
        if answer and (code is None or answer.start() < _first_call(assistant_turn)):
            right = answer.group(1) == self.answer
            return StepResult([], 1.0 if right else 0.0, True)
        if code is None:
            return StepResult([], 0.0, True)
        return self._call_tool(code)

    def _call_tool(self, code: str) -> StepResult:
        if self._sandbox is None:
            self._sandbox = PythonSandbox(self.limits)
        result = self._sandbox.run(code)
        stats = self.tool_stats
        stats.calls += 1
        reward = None
        if result.ok:
            content = result.output.strip()
            if not self._bonus_paid and self.tool_bonus:
                reward, self._bonus_paid = self.tool_bonus, True
        else:
            stats.timeouts += result.status == "timeout"
            stats.errors += result.status != "timeout"
            stats.error_log.append(result.error or result.status)
            log.warning("arithmetic_tool: %s", result.error)
            content = f"Error: {result.error}"
        return StepResult([{"role": "tool", "content": content}], reward, False)

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None


def _first_call(text: str) -> int:
    starts = [m.start() for m in (_PYTHON.search(text), _TOOL_CALL.search(text)) if m]
    return min(starts) if starts else len(text)
