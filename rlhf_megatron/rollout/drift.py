"""The drift alarm: after a refit, vLLM's log-probs of the sampled tokens must stay within the
rollout dtype's own noise of the trainer's (rollout/metrics.py computes the difference).

A difference above that noise means the rollout samples from weights the trainer does not have:
a refit that skipped or misplaced a tensor, a stale prefix cache, or an fp32 actor whose updates
round away in a bf16 rollout (docs/ROLLOUT_AND_REFIT.md, "The sampled weights are the trained
weights"). The check is `LogprobDriftAlarm.check`, called once a step by both loops (through
controller/phases.py check_logprob_drift).
"""

from __future__ import annotations

import logging

from rlhf_megatron.errors import RlhfMegatronError

logger = logging.getLogger(__name__)

DRIFT_MODES = ("warn", "error")

DEFAULT_MAX_LOGPROB_DIFF = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}
"""rollout.max_logprob_diff when unset, by compute dtype (the less precise of the actor's and the
rollout's). Measured step-1 `rollout/logprob_diff_mean` with matching dtypes, on hidden 64 x 2
layers to 256 x 8 and 512 x 2 (docs/ROLLOUT_AND_REFIT.md has the table): fp32 <= 1.8e-7 nats,
bf16 <= 3.2e-3. The thresholds sit well above that: fp32 ~5000x, bf16 ~6x. fp16 takes bf16's
(not measured). A deep bf16 model may need more: the issue's 30-layer model read 0.032 at step 1
with an fp32 actor; set rollout.max_logprob_diff."""

_ACTOR_TO_ROLLOUT_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_PRECISION_ORDER = ("float32", "bfloat16", "float16")


class LogprobDriftError(RlhfMegatronError):
    """rollout/logprob_diff_mean exceeded rollout.max_logprob_diff (rollout.on_logprob_drift:
    error); the message gives the figures."""


def rollout_dtype_name(dtype: str) -> str:
    """'fp32' / 'bf16' (an engine's) or 'float32' / 'bfloat16' / 'auto' (vLLM's) -> vLLM's name."""
    return _ACTOR_TO_ROLLOUT_DTYPE.get(dtype, dtype)


def default_max_logprob_diff(actor_dtype: str, rollout_dtype: str) -> float:
    """The threshold of the less precise of the two compute dtypes (unknown names: bf16's)."""
    names = [rollout_dtype_name(actor_dtype), rollout_dtype_name(rollout_dtype)]
    ranks = [_PRECISION_ORDER.index(n) if n in _PRECISION_ORDER else 1 for n in names]
    return DEFAULT_MAX_LOGPROB_DIFF[_PRECISION_ORDER[max(ranks)]]


class LogprobDriftAlarm:
    """Warns once (mode 'warn') or raises LogprobDriftError (mode 'error') the first time the
    step's rollout-vs-trainer log-prob difference exceeds `threshold` (nats)."""

    def __init__(self, threshold: float, mode: str = "warn") -> None:
        if mode not in DRIFT_MODES:
            raise ValueError(f"on_logprob_drift={mode!r}: expected one of {list(DRIFT_MODES)}")
        self.threshold, self.mode = threshold, mode
        self.warned = False

    @staticmethod
    def observed(metrics: dict[str, float], *, per_token_versions: bool) -> float | None:
        """The figure to judge: rollout/logprob_diff_mean, or with per-token versions (async
        modes) rollout/logprob_diff_lag0, the tokens sampled by the trainer's current weights
        (older ones differ by the policy's own change); None when the step has no such tokens."""
        key = "rollout/logprob_diff_lag0" if per_token_versions else "rollout/logprob_diff_mean"
        return metrics.get(key)

    def check(self, step: int, weight_version: int, metrics: dict[str, float], *,
              per_token_versions: bool = False) -> bool:
        """Judge one step's metrics; True when the difference is above the threshold."""
        diff = self.observed(metrics, per_token_versions=per_token_versions)
        if diff is None or diff <= self.threshold:  # a NaN difference is drift too
            return False
        what = "rollout/logprob_diff_lag0" if per_token_versions else "rollout/logprob_diff_mean"
        message = (
            f"step {step}: {what}={diff:.3g} nats (max {metrics.get('rollout/logprob_diff_max', 0):.3g}) "
            f"exceeds rollout.max_logprob_diff={self.threshold:g} on the weights of version "
            f"{weight_version}: the rollout samples from other weights than the trainer's (a "
            "refit that missed a tensor, or an actor dtype other than the rollout's)")
        if self.mode == "error":
            raise LogprobDriftError(message)
        if not self.warned:
            self.warned = True
            logger.warning(message)
        return True
