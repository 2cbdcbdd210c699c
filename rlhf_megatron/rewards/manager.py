"""Batch reward computation for the controller.

``RewardManager.compute`` turns a batch of decoded responses into a ``(bs,)`` float32 tensor, using
either the rule registry (routed per sample by ``data_source``) or one custom batched function.
``compute_async`` runs the same work on the manager's thread pool and returns a ``Future``, so the
controller can score a rollout while it computes log-probs; call ``close()`` (or use the manager as
a context manager) to stop the pool.

A custom function runs in a child process (rewards/process.py) with a deadline,
``reward.timeout_s`` (default 300 s per batch): on overrun the process is killed and the batch
either fails with a one-line RewardTimeout naming the function (``on_timeout: error``, the
default) or scores 0 with a logged count (``on_timeout: zero``). ``close()`` kills that process
and never waits on user code. Rule rewards are this package's own code and run in the thread.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from rlhf_megatron.rewards.custom import CustomReward, load_custom_reward
from rlhf_megatron.rewards.errors import RewardError
from rlhf_megatron.rewards.process import RewardProcess, RewardTimeout
from rlhf_megatron.rewards.rules import get_rule_reward

ON_TIMEOUT = ("error", "zero")


@dataclasses.dataclass
class RewardConfig:
    """How rewards are computed."""

    reward_name: str = "math_numeric"
    """Rule reward for samples whose data_source is not in ``by_data_source``
    (see ``rlhf_megatron.rewards.RULE_REWARDS``)."""

    by_data_source: dict[str, str] = dataclasses.field(default_factory=dict)
    """data_source -> rule reward name, e.g. ``{"openai/gsm8k": "gsm8k", "math": "boxed"}``."""

    custom_function: str | None = None
    """``"path/to/file.py:function"``, a reward function that replaces the rule rewards:
    batched, or verl's per-sample ``compute_score`` (rewards/custom.py)."""

    format_score: float = 0.0
    """Reward of a rule-parsable but wrong answer (0.0 = plain accuracy)."""

    max_workers: int = 1
    """Threads for ``compute_async`` (rule rewards hold the GIL, so 1 is usually enough)."""

    timeout_s: float = 300.0
    """Deadline of one call of ``custom_function`` on a batch (seconds). It runs in a child
    process that is killed on overrun; see ``on_timeout``."""

    on_timeout: str = "error"
    """``"error"``: an overrun ends the step with one line naming the function; ``"zero"``: the
    batch scores 0 and the overruns are counted in the log."""

    def validate(self) -> None:
        """Raise :class:`RewardError` naming the first invalid field."""
        for name in (self.reward_name, *self.by_data_source.values()):
            get_rule_reward(name)  # unknown name -> error listing the known ones
        if self.max_workers < 1:
            raise RewardError(f"RewardConfig.max_workers must be >= 1, got {self.max_workers!r}")
        if not (isinstance(self.timeout_s, int | float) and math.isfinite(self.timeout_s)
                and self.timeout_s > 0):
            raise RewardError(f"reward.timeout_s={self.timeout_s!r} must be a number > 0")
        if self.on_timeout not in ON_TIMEOUT:
            raise RewardError(f"reward.on_timeout={self.on_timeout!r}: expected one of "
                              f"{', '.join(ON_TIMEOUT)}")


class RewardManager:
    """Scores batches of responses; owns the custom function and the thread pool.

    Args:
        cfg: validated here; a custom function is loaded once, here.
    """

    def __init__(self, cfg: RewardConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.custom: CustomReward | None = (
            load_custom_reward(cfg.custom_function) if cfg.custom_function else None
        )
        self._pool: ThreadPoolExecutor | None = None  # created on first compute_async
        self._process: RewardProcess | None = (
            RewardProcess(cfg.custom_function) if self.custom is not None else None
        )
        self.timeouts = 0
        """Batches scored 0 after an overrun (``on_timeout: zero``)."""
        self._metrics: list[tuple[int, dict[str, float]]] = []  # (batch size, its means)
        self._metrics_lock = threading.Lock()

    def compute(
        self,
        responses: list[str],
        answers: list[str],
        data_sources: list[str] | None = None,
        **extra: Any,
    ) -> torch.Tensor:
        """Rewards of a batch, shape ``(bs,)`` float32 on CPU.

        Args:
            responses: decoded responses, ``bs`` of them.
            answers: the reference answer of each response.
            data_sources: the dataset of each response, routed through ``cfg.by_data_source``
                (None -> every sample uses ``cfg.reward_name``).
            extra: further per-batch fields, passed to a custom function only.
        """
        bs = len(responses)
        if len(answers) != bs:
            raise RewardError(f"got {len(answers)} answers for {bs} responses")
        if data_sources is not None and len(data_sources) != bs:
            raise RewardError(f"got {len(data_sources)} data_sources for {bs} responses")
        if self._process is not None:
            rewards = self._call_custom(list(responses), list(answers),
                                        {"data_sources": data_sources, **extra})
        else:
            rewards = self._compute_rules(responses, answers, data_sources)
        return torch.tensor(rewards, dtype=torch.float32).reshape(bs)

    def _call_custom(self, responses: list[str], answers: list[str],
                     extra: dict[str, Any]) -> list[float]:
        assert self._process is not None
        try:
            rewards, metrics = self._process.call(responses, answers, extra, self.cfg.timeout_s)
        except RewardTimeout as exc:
            if self.cfg.on_timeout == "error":
                raise
            self.timeouts += 1
            message = (f"{exc}; scored the batch of {len(responses)} as 0 "
                       f"({self.timeouts} timed-out batches so far)")
            print(f"[rlhf_megatron] warning: {message}", file=sys.stderr, flush=True)
            return [0.0] * len(responses)
        if metrics:
            with self._metrics_lock:
                self._metrics.append((len(responses), metrics))
        return rewards

    def take_metrics(self) -> dict[str, float]:
        """The means of a custom function's extra keys (``reward/<key>``) over the batches scored
        since the last call, weighted by batch size; then forgets them."""
        with self._metrics_lock:
            batches, self._metrics = self._metrics, []
        totals: dict[str, list[float]] = {}
        for size, metrics in batches:
            for key, value in metrics.items():
                total = totals.setdefault(key, [0.0, 0.0])
                total[0] += size * value
                total[1] += size
        return {key: total / count for key, (total, count) in totals.items()}

    def _compute_rules(
        self, responses: list[str], answers: list[str], data_sources: list[str] | None
    ) -> list[float]:
        sources = data_sources if data_sources is not None else [None] * len(responses)
        rewards = []
        for response, answer, source in zip(responses, answers, sources, strict=True):
            name = self.cfg.by_data_source.get(source, self.cfg.reward_name)
            fn = get_rule_reward(name)
            rewards.append(fn(response, answer, format_score=self.cfg.format_score))
        return rewards

    def compute_async(
        self,
        responses: list[str],
        answers: list[str],
        data_sources: list[str] | None = None,
        **extra: Any,
    ) -> Future[torch.Tensor]:
        """:meth:`compute` on the thread pool; ``future.result()`` returns the ``(bs,)`` tensor or
        raises the same :class:`RewardError`. The lists are copied, so the caller may reuse them."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.cfg.max_workers, thread_name_prefix="reward"
            )
        sources = list(data_sources) if data_sources is not None else None
        return self._pool.submit(self.compute, list(responses), list(answers), sources, **extra)

    def close(self) -> None:
        """Kill the custom function's process and stop the pool without waiting on user code
        (pending futures fail; a later call starts afresh)."""
        if self._process is not None:
            self._process.kill()  # a thread waiting on it sees the pipe close and returns
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
