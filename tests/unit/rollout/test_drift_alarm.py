"""The drift alarm (rollout/drift.py) and its settings: warns once with the figures, stops the run
with one typed line in error mode, judges lag-0 tokens in async modes; validation warns in one line
when the actor's compute dtype is not the rollout's."""

from __future__ import annotations

import logging

import pytest

from rlhf_megatron.config import load_config, validate_config
from rlhf_megatron.config.validate import config_warnings
from rlhf_megatron.errors import ConfigError, RlhfMegatronError
from rlhf_megatron.rollout.drift import (
    DEFAULT_MAX_LOGPROB_DIFF,
    LogprobDriftAlarm,
    LogprobDriftError,
    default_max_logprob_diff,
)

DRIFT_LOGGER = "rlhf_megatron.rollout.drift"


def _metrics(mean: float, top: float = 0.5) -> dict[str, float]:
    return {"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": top}


def test_warns_once_with_the_figures_and_stays_quiet_below(caplog):
    alarm = LogprobDriftAlarm(0.02, "warn")
    with caplog.at_level(logging.WARNING, logger=DRIFT_LOGGER):
        assert not alarm.check(1, 0, _metrics(0.02))  # at the threshold: not above it
        assert alarm.check(2, 1, _metrics(0.11, 2.5))
        assert alarm.check(3, 2, _metrics(0.23))  # still above, but warned already
        assert not alarm.check(4, 3, _metrics(0.001))
    records = [r for r in caplog.records if r.name == DRIFT_LOGGER]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "\n" not in message
    for figure in ("step 2", "rollout/logprob_diff_mean=0.11", "max 2.5",
                   "rollout.max_logprob_diff=0.02", "version 1"):
        assert figure in message, message


def test_error_mode_raises_one_typed_line():
    alarm = LogprobDriftAlarm(1e-3, "error")
    assert not alarm.check(1, 0, _metrics(2e-6))
    with pytest.raises(LogprobDriftError) as info:
        alarm.check(2, 1, _metrics(0.05))
    assert isinstance(info.value, RlhfMegatronError)  # the CLI prints it as one line, rc 2
    assert "\n" not in str(info.value) and "0.05" in str(info.value)


def test_nan_and_missing_metrics():
    alarm = LogprobDriftAlarm(1e-3, "error")
    assert not alarm.check(1, 0, {})  # a step without the policy forward (critic warm-up)
    for bad in (float("inf"), float("nan")):
        with pytest.raises(LogprobDriftError):
            alarm.check(2, 1, _metrics(bad))


def test_async_modes_judge_only_lag0_tokens():
    alarm = LogprobDriftAlarm(0.02, "error")
    stale = {**_metrics(0.4), "rollout/logprob_diff_lag1": 0.4}  # the policy's own change
    assert not alarm.check(3, 2, stale, per_token_versions=True)
    with pytest.raises(LogprobDriftError, match="lag0=0.3"):
        alarm.check(4, 3, {**stale, "rollout/logprob_diff_lag0": 0.3}, per_token_versions=True)


def test_default_threshold_is_the_less_precise_dtype():
    assert default_max_logprob_diff("fp32", "float32") == DEFAULT_MAX_LOGPROB_DIFF["float32"]
    assert default_max_logprob_diff("bf16", "bfloat16") == DEFAULT_MAX_LOGPROB_DIFF["bfloat16"]
    assert default_max_logprob_diff("fp32", "bfloat16") == DEFAULT_MAX_LOGPROB_DIFF["bfloat16"]
    assert default_max_logprob_diff("bf16", "float32") == DEFAULT_MAX_LOGPROB_DIFF["bfloat16"]
    assert DEFAULT_MAX_LOGPROB_DIFF["float32"] < DEFAULT_MAX_LOGPROB_DIFF["bfloat16"]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="on_logprob_drift"):
        LogprobDriftAlarm(0.1, "stop")


@pytest.mark.parametrize("override, message", [
    ("rollout.on_logprob_drift=stop", "rollout.on_logprob_drift='stop': expected one of warn"),
    ("rollout.max_logprob_diff=0", "rollout.max_logprob_diff=0.0 must be > 0"),
])
def test_validation_refuses_bad_alarm_settings(override, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(None, [override]), check_paths=False)


@pytest.mark.parametrize("actor, rollout, warns", [
    ("fp32", "bfloat16", True), ("bf16", "float32", True),
    ("fp32", "float32", False), ("bf16", "bfloat16", False),
])
def test_validation_warns_in_one_line_when_the_dtypes_differ(actor, rollout, warns):
    cfg = load_config(None, [f"actor.engine.dtype={actor}", f"rollout.engine.dtype={rollout}"])
    validate_config(cfg, check_paths=False)  # valid: the run goes on, the drift alarm watches it
    lines = config_warnings(cfg)
    assert len(lines) == int(warns), lines
    if warns:
        assert "\n" not in lines[0]
        assert lines[0].startswith(f"actor.engine.dtype={actor} but rollout.engine.dtype={rollout}")


def _run(mode: str, actor: str = "bf16", rollout: str = "bfloat16", **alarm):
    from types import SimpleNamespace

    from rlhf_megatron.controller.phases import Run

    cfg = load_config(None, [f"trainer.rollout_mode={mode}", f"actor.engine.dtype={actor}",
                             f"rollout.engine.dtype={rollout}",
                             *(f"rollout.{k}={v}" for k, v in alarm.items())])
    return Run(cfg, *(SimpleNamespace() for _ in range(6)))


def test_the_loops_check_builds_one_alarm_from_the_config(caplog):
    from rlhf_megatron.controller.phases import check_logprob_drift

    run = _run("sync")
    with caplog.at_level(logging.WARNING, logger=DRIFT_LOGGER):
        check_logprob_drift(run, 1, {**_metrics(0.003), "rollout/weight_version": 0.0}, 0)
        check_logprob_drift(run, 2, {**_metrics(0.05), "rollout/weight_version": 1.0}, 1)
        check_logprob_drift(run, 3, {**_metrics(0.06), "rollout/weight_version": 2.0}, 2)
    assert run.drift_alarm.threshold == DEFAULT_MAX_LOGPROB_DIFF["bfloat16"]
    messages = [r.getMessage() for r in caplog.records if r.name == DRIFT_LOGGER]
    assert len(messages) == 1 and "step 2" in messages[0] and "version 1" in messages[0]
    assert _run("sync", "fp32", "float32").cfg.rollout.max_logprob_diff is None


def test_the_loops_check_in_error_mode_and_async(caplog):
    from rlhf_megatron.controller.phases import check_logprob_drift

    run = _run("async", on_logprob_drift="error", max_logprob_diff=0.01)
    stale = {**_metrics(0.3), "rollout/logprob_diff_lag1": 0.3}
    check_logprob_drift(run, 4, stale, 3)  # no lag-0 tokens: nothing to judge
    with pytest.raises(LogprobDriftError, match="step 5: rollout/logprob_diff_lag0=0.02 .*version 4"):
        check_logprob_drift(run, 5, {**stale, "rollout/logprob_diff_lag0": 0.02}, 4)
