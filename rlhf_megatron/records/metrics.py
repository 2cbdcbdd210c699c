"""Per-step metrics: sinks (console, JSONL, TensorBoard, optional W&B), one logger that fans out
to them, a reader for ``metrics.jsonl`` and a per-phase wall-clock timer.

    logger = build_metrics_logger(run_dir, console=True, tensorboard=True, wandb_project=None,
                                  run_name="grpo-qwen", config_dict=cfg, resume_step=None)
    timer = PhaseTimer()
    with timer.phase("rollout"):
        ...
    logger.log(step, {**train_metrics, **timer.metrics()})
    logger.close()

``metrics.jsonl`` is the durable record: one ``{"step": step, **metrics}`` object per line, fsynced
after each line, non-finite floats written as ``null``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from tqdm import tqdm

from rlhf_megatron.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_CONSOLE_KEYS: tuple[str, ...] = (
    "reward/mean",
    "reward/std",
    "kl",
    "actor/entropy",
    "actor/clipfrac",
    "actor/grad_norm",
    "response/length_mean",
    "rollout/tokens_per_s",
    "time/step",
)
"""Keys ``ConsoleSink`` shows by default, in this order, when present in a step's metrics."""


class MetricsSink(Protocol):
    """Where one step's metrics go. ``log`` is called once per step, ``close`` once at the end."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` for training step ``step``."""

    def close(self) -> None:
        """Flush and release the sink's resources."""


def _json_value(value: Any) -> float | int | None:
    """A metric as a JSON-safe number: ints stay ints, non-finite floats become ``None``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = float(value)  # also accepts numpy scalars and 0-d tensors
    return number if math.isfinite(number) else None


class ConsoleSink:
    """One compact line per step on stdout: ``step 3 | reward/mean 0.41 | kl 0.002 | ...``.

    Only the keys in ``keys`` that the step has are shown; floats use 4 significant digits.
    """

    def __init__(self, keys: Sequence[str] = DEFAULT_CONSOLE_KEYS, stream: TextIO | None = None):
        self.keys = tuple(keys)
        # None means "sys.stdout at the time of the call", so redirections made later still apply.
        self._stream = stream

    def format_line(self, step: int, metrics: dict[str, float]) -> str:
        """The line ``log`` prints for this step."""
        parts = [f"step {step}"]
        for key in self.keys:
            if key in metrics:
                value = _json_value(metrics[key])
                parts.append(f"{key} {'nan' if value is None else format(value, '.4g')}")
        return " | ".join(parts)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Print this step's line. Through ``tqdm.write``: a progress bar on the same terminal
        (controller/loop.py, on stderr) is cleared first and redrawn below the line, so the two
        never share a line."""
        stream = self._stream or sys.stdout
        tqdm.write(self.format_line(step, metrics), file=stream)
        stream.flush()

    def close(self) -> None:
        """Nothing to release."""


def _split_complete_lines(path: Path) -> tuple[list[str], bool]:
    """The newline-terminated lines of ``path`` and whether a partial trailing line was dropped."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    # The element after the last "\n" is "" for a well-formed file, else a line cut by a kill.
    partial = lines.pop() != ""
    return [line for line in lines if line.strip()], partial


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """All complete records of a ``metrics.jsonl``, in file order.

    A partial trailing line (the process was killed while writing it) is skipped.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"metrics file {path} does not exist")
    lines, _ = _split_complete_lines(path)
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s: skipping unreadable line %d", path, number)
    return records


class JsonlSink:
    """Appends ``{"step": step, **metrics}`` to a JSONL file, one fsynced line per step.

    On open an existing file is rewritten (atomically) without its partial trailing line and, when
    ``resume_step`` is given, without the lines whose step is ``>= resume_step``, so that a resumed
    run does not record a step twice. ``resume_step=None`` keeps every complete line.
    """

    def __init__(self, path: Path | str, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._truncate_for_resume(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()

    def _truncate_for_resume(self, resume_step: int | None) -> None:
        lines, partial = _split_complete_lines(self.path)
        kept = []
        for line in lines:
            try:
                step = json.loads(line).get("step")
            except (json.JSONDecodeError, AttributeError):
                continue
            if resume_step is None or (isinstance(step, int) and step < resume_step):
                kept.append(line)
        if not partial and len(kept) == len(lines):
            return
        logger.info("%s: keeping %d of %d records", self.path, len(kept), len(lines))
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append this step's record and fsync it (a kill loses at most the line being written)."""
        record = {"step": step, **{key: _json_value(value) for key, value in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class TensorBoardSink:
    """One ``add_scalar`` per metric under ``log_dir``, flushed every step."""

    def __init__(self, log_dir: Path | str):
        from torch.utils.tensorboard import SummaryWriter  # slow import: only when asked for

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write every metric as a scalar at ``step``."""
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def wandb_missing(project: str) -> str:
    """The one line for metrics.wandb_project set without wandb installed (validation finds it
    before Ray, config/model_files.py; the sink would find it after the workers start)."""
    return (f"metrics.wandb_project={project!r} but wandb is not installed: "
            "`pip install wandb` or unset metrics.wandb_project")


class WandbSink:
    """Logs to Weights & Biases. ``wandb`` is optional and imported only when this sink is built."""

    def __init__(self, project: str, run_name: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError(wandb_missing(project)) from None
        self._run = wandb.init(project=project, name=run_name, config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log this step's metrics at ``step``."""
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the W&B run."""
        self._run.finish()


class MetricsLogger:
    """Fans each step's metrics out to every sink; the controller's one way to record metrics."""

    def __init__(self, sinks: Sequence[MetricsSink]):
        self.sinks = list(sinks)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Send ``metrics`` of ``step`` to every sink, in order."""
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        """Close every sink, even if one fails; the first failure is raised afterwards."""
        first_error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # closing the others matters more
                logger.exception("closing %s failed", type(sink).__name__)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_metrics_logger(
    run_dir: Path,
    *,
    console: bool,
    tensorboard: bool,
    wandb_project: str | None,
    run_name: str,
    config_dict: dict[str, Any],
    resume_step: int | None,
    console_keys: Sequence[str] | None = None,
) -> MetricsLogger:
    """The run's logger: ``run_dir/metrics.jsonl`` always, then the console,
    ``run_dir/tensorboard/`` and W&B as asked. ``resume_step`` is the first step the run will
    log again (records from it on are dropped from metrics.jsonl); ``None`` for a fresh run.
    ``console_keys``: what the console shows (default ``DEFAULT_CONSOLE_KEYS``)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step=resume_step)]
    if console:
        sinks.append(ConsoleSink() if console_keys is None else ConsoleSink(keys=console_keys))
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if wandb_project:
        sinks.append(WandbSink(wandb_project, run_name, config_dict))
    return MetricsLogger(sinks)


class PhaseTimer:
    """Wall-clock seconds per named phase of a step (``time/<phase>``), and their sum as
    ``time/step``. Phases must not nest, or ``time/step`` counts the inner one twice."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block and add it to phase ``name`` (also when the block raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``{"time/<phase>": seconds, ..., "time/step": total}`` since the last ``reset``."""
        out = {f"time/{name}": seconds for name, seconds in self._seconds.items()}
        out["time/step"] = sum(self._seconds.values())
        return out

    def reset(self) -> None:
        """Forget all phases (call at the start of each step)."""
        self._seconds.clear()
