"""plot_metrics and its CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.records.plot import main, plot_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "reward/mean": 0.1 * s, "kl": None if s == 2 else 0.01} for s in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "rew')
    return path


def test_plot_metrics_writes_png_and_skips_missing_keys(tmp_path):
    out = plot_metrics(
        _metrics_file(tmp_path), tmp_path / "plots" / "m.png", keys=("reward/mean", "kl", "absent")
    )
    assert out == tmp_path / "plots" / "m.png"
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert [p.name for p in out.parent.iterdir()] == ["m.png"]  # no temp file left behind


def test_plot_metrics_no_key_present_names_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"\['nope', 'also/nope'\]"):
        plot_metrics(_metrics_file(tmp_path), tmp_path / "m.png", keys=("nope", "also/nope"))
    assert not (tmp_path / "m.png").exists()


def test_cli_main_writes_png_and_reports_bad_input(tmp_path, capsys):
    metrics = _metrics_file(tmp_path)
    assert main([str(metrics), str(tmp_path / "a.png"), "--keys", "kl"]) == 0
    assert (tmp_path / "a.png").read_bytes().startswith(PNG_MAGIC)
    assert main([str(tmp_path / "missing.jsonl"), str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_cli_module_help():
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_megatron.records.plot", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=30,
        check=True,
    )
    assert "METRICS_JSONL" in result.stdout.upper() and "--keys" in result.stdout
