"""`plan` on bad input (issue 28 item 6): a GPU memory so large that the byte counts overflow is
refused in one line, and a config error comes first and alone, before any of the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.cli import main
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.planner.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
PLANNED = REPO / "configs" / "qwen2.5-32b_grpo_2x8.yaml"


def _plan(*args: str) -> int:
    try:
        return main(["plan", "--config", str(PLANNED), "--nodes", "2", "--gpus-per-node", "8",
                     *args])
    except SystemExit as exc:  # argparse rejects the value itself
        return int(exc.code)


@pytest.mark.parametrize("value", ["1e300", "1e7"])
def test_plan_refuses_a_gpu_memory_beyond_any_device(capsys, value):
    code = _plan("--gpu-mem-gb", value)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured.out
    assert "Traceback" not in captured.err
    assert captured.err.strip().splitlines()[-1].endswith(
        f"argument --gpu-mem-gb: '{value}': must be a number of GiB > 0 and <= 1e+06")


def test_cluster_refuses_an_overflowing_memory():
    with pytest.raises(ConfigError, match="gpu_mem_gb=1e\\+300"):
        Cluster(1, 8, 1e300)
    assert Cluster(1, 8, 1e6).gpu_mem_gib == 1e6


def test_plan_config_error_comes_first_and_alone(capsys):
    code = _plan("--gpu-mem-gb", "80", "trainer.total_steps=0")
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == "", captured.out  # no "Verdict: FITS" before the error
    assert captured.err.splitlines() == [
        "rlhf-megatron: error: trainer.total_steps=0 must be >= 1"]


def test_plan_that_fits_still_prints_its_verdict(capsys):
    assert _plan("--gpu-mem-gb", "80") == 0
    assert "Verdict: FITS" in capsys.readouterr().out
