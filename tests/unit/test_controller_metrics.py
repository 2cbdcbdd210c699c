"""Metrics sinks, the fan-out logger, metrics.jsonl reading/resume truncation and PhaseTimer."""

import json
import math
import sys
import time
import types

import pytest

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.records.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    PhaseTimer,
    TensorBoardSink,
    WandbSink,
    build_metrics_logger,
    read_metrics,
)


def test_console_sink_formats_known_keys_with_4_significant_digits(capsys):
    sink = ConsoleSink()
    sink.log(3, {"reward/mean": 0.412345, "kl": 0.0021234, "other": 1.0, "time/step": 12.3456})
    out = capsys.readouterr().out
    assert out == "step 3 | reward/mean 0.4123 | kl 0.002123 | time/step 12.35\n"


def test_console_sink_custom_keys_and_nan(capsys):
    ConsoleSink(keys=["b", "a"]).log(1, {"a": 1.5, "b": float("nan")})
    assert capsys.readouterr().out == "step 1 | b nan | a 1.5\n"


def test_jsonl_sink_writes_one_line_per_step_and_nulls_non_finite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(0, {"reward/mean": 0.5, "kl": float("nan"), "n": 3})
    sink.log(1, {"reward/mean": float("inf")})
    sink.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 0, "reward/mean": 0.5, "kl": None, "n": 3},
        {"step": 1, "reward/mean": None},
    ]
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_jsonl_sink_resume_truncates_later_steps_and_partial_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(6):
        sink.log(step, {"x": float(step)})
    sink.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "x"')  # killed mid-line
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4, 5]

    sink = JsonlSink(path, resume_step=4)
    sink.log(4, {"x": 40.0})
    sink.close()
    assert [(r["step"], r["x"]) for r in read_metrics(path)] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]


def test_jsonl_sink_without_resume_step_keeps_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1}\n{"step": 1, "x"')
    sink = JsonlSink(path)
    sink.log(1, {"x": 2.0})
    sink.close()
    assert read_metrics(path) == [{"step": 0, "x": 1}, {"step": 1, "x": 2.0}]


def test_read_metrics_missing_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_metrics(tmp_path / "nope.jsonl")


def test_tensorboard_sink_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    sink.log(1, {"reward/mean": 0.25})
    sink.log(2, {"reward/mean": 0.5})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = acc.Scalars("reward/mean")
    assert [(e.step, e.value) for e in events] == [(1, 0.25), (2, 0.5)]


def test_wandb_sink_without_wandb_is_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ConfigError, match="pip install wandb"):
        WandbSink("proj", "run", {})


def test_wandb_sink_logs_through_run(monkeypatch):
    calls = []

    class FakeRun:
        def log(self, metrics, step):
            calls.append(("log", step, metrics))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = WandbSink("proj", "run", {"lr": 1e-6})
    sink.log(7, {"kl": 0.1})
    sink.close()
    assert calls == [
        ("init", {"project": "proj", "name": "run", "config": {"lr": 1e-6}}),
        ("log", 7, {"kl": 0.1}),
        ("finish",),
    ]


def test_metrics_logger_fans_out_and_closes_all_even_if_one_fails():
    seen = []

    class Recorder:
        def __init__(self, name, fail_close=False):
            self.name, self.fail_close = name, fail_close

        def log(self, step, metrics):
            seen.append((self.name, step, dict(metrics)))

        def close(self):
            seen.append((self.name, "closed"))
            if self.fail_close:
                raise RuntimeError("boom")

    logger = MetricsLogger([Recorder("a", fail_close=True), Recorder("b")])
    logger.log(2, {"kl": 1.0})
    with pytest.raises(RuntimeError, match="boom"):
        logger.close()
    assert seen == [("a", 2, {"kl": 1.0}), ("b", 2, {"kl": 1.0}), ("a", "closed"), ("b", "closed")]


def test_build_metrics_logger_layout(tmp_path, capsys):
    run_dir = tmp_path / "run"
    logger = build_metrics_logger(
        run_dir,
        console=True,
        tensorboard=True,
        wandb_project=None,
        run_name="r",
        config_dict={},
        resume_step=None,
    )
    logger.log(0, {"reward/mean": 1.0})
    logger.close()
    assert read_metrics(run_dir / "metrics.jsonl") == [{"step": 0, "reward/mean": 1.0}]
    assert any((run_dir / "tensorboard").iterdir())
    assert "step 0 | reward/mean 1" in capsys.readouterr().out


def test_build_metrics_logger_wandb_missing_is_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="metrics.wandb_project"):
        build_metrics_logger(
            tmp_path,
            console=False,
            tensorboard=False,
            wandb_project="p",
            run_name="r",
            config_dict={},
            resume_step=None,
        )


def test_phase_timer_accumulates_and_resets():
    timer = PhaseTimer()
    with timer.phase("rollout"):
        time.sleep(0.02)
    with timer.phase("train"):
        time.sleep(0.01)
    with pytest.raises(ValueError), timer.phase("rollout"):
        raise ValueError
    m = timer.metrics()
    assert set(m) == {"time/rollout", "time/train", "time/step"}
    assert m["time/rollout"] >= 0.02 and m["time/train"] >= 0.01
    assert math.isclose(m["time/step"], m["time/rollout"] + m["time/train"])
    timer.reset()
    assert timer.metrics() == {"time/step": 0.0}
