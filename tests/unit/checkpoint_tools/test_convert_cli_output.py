"""`rlhf-convert` output (issue 28 item 6): its usage names `rlhf-convert`, and bad input is one
line on stderr, without Megatron-Core's import-time warnings about Transformer Engine / Apex."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from checkpoint_tools.__main__ import build_parser

REPO = Path(__file__).resolve().parents[3]


def test_usage_names_rlhf_convert():
    assert build_parser().format_usage().startswith("usage: rlhf-convert ")


def test_bad_input_prints_exactly_one_line(tmp_path):
    missing = tmp_path / "no_such_hf_dir"
    result = subprocess.run(
        [sys.executable, "-m", "checkpoint_tools", "hf-to-mcore", "--hf", str(missing),
         "--out", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"error: HF directory {missing} does not exist"], \
        result.stderr
