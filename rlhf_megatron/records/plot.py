"""Plot a run's ``metrics.jsonl``: one subplot per metric against the step, written as a PNG.

    python -m rlhf_megatron.records.plot runs/grpo/metrics.jsonl runs/grpo/metrics.png \\
        --keys reward/mean kl response/length_mean
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rlhf_megatron.errors import ConfigError, RlhfMegatronError
from rlhf_megatron.records.metrics import read_metrics

DEFAULT_PLOT_KEYS: tuple[str, ...] = ("reward/mean", "kl")

EXIT_BAD_INPUT = 2


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a non-null ``key``."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None and "step" in r]
    return [step for step, _ in points], [float(value) for _, value in points]


def plot_metrics(
    metrics_jsonl: Path, out_png: Path, keys: Sequence[str] = DEFAULT_PLOT_KEYS
) -> Path:
    """Draw one subplot per key of ``keys`` found in ``metrics_jsonl`` and write ``out_png``.

    Keys with no value are skipped; if none has one, ``ConfigError`` names them. The PNG is
    written to a temporary file and renamed, so a reader never sees a half-written image.
    """
    # Figure + the Agg canvas directly: no pyplot, so no global backend or figure state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics_jsonl, out_png = Path(metrics_jsonl), Path(out_png)
    records = read_metrics(metrics_jsonl)
    series = {key: _series(records, key) for key in keys}
    present = [key for key in keys if series[key][0]]
    if not present:
        raise ConfigError(f"none of the keys {list(keys)} has a value in {metrics_jsonl}")

    fig = Figure(figsize=(7.0, 2.6 * len(present)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, present):
        steps, values = series[key]
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, linewidth=1.2)
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.suptitle(str(metrics_jsonl.parent.name or metrics_jsonl.name))

    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(f".{out_png.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, out_png)
    finally:
        tmp.unlink(missing_ok=True)
    return out_png


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_megatron.records.plot",
        description="Plot metrics from a run's metrics.jsonl (one subplot per key) to a PNG.",
    )
    parser.add_argument("metrics_jsonl", type=Path, help="path to the run's metrics.jsonl")
    parser.add_argument("out_png", type=Path, help="PNG to write (replaced atomically)")
    parser.add_argument(
        "--keys",
        nargs="+",
        default=list(DEFAULT_PLOT_KEYS),
        help="metric keys to plot; missing ones are skipped "
        f"(default: {' '.join(DEFAULT_PLOT_KEYS)})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; a bad input prints one line to stderr and returns a non-zero exit code."""
    args = build_parser().parse_args(argv)
    try:
        out = plot_metrics(args.metrics_jsonl, args.out_png, keys=args.keys)
    except RlhfMegatronError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
