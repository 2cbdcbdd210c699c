"""The tools quickstart's SFT warm start, built once per pytest run for both GRPO files
(test_episodes_e2e.py, sync; test_episodes_async_e2e.py, async): under pytest-xdist the two files
run on different workers, and the second waits for the first's build instead of repeating it.

Both files' runs, the warm start included, run with the instruction set capped at AVX2
(`avx2_head`): these are the suite's multi-turn learning margins, and `make test` checks them
at AVX2 once instead of at the machine's own ISA and again under `make test-portable`'s cap
(~240 s of CI). The suite's other learning runs (GRPO, async, DAPO, offline) run at the machine's
own ISA, so one CI run holds learning margins at both."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.testing.fixtures import built_once
from rlhf_megatron.testing.tools_runs import build_warm_start, warm_start_paths
from rlhf_megatron.testing.train_runs import AVX2_CAP_ENV, RayHead


@pytest.fixture(scope="session")
def avx2_head():
    """A Ray cluster whose workers, and the drivers that join it, run torch, MKL and oneDNN
    capped at AVX2 (AVX2_CAP_ENV); one per xdist worker that runs these files."""
    cluster = RayHead(num_cpus=4, env=AVX2_CAP_ENV)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory: pytest.TempPathFactory, avx2_head: RayHead
               ) -> dict[str, Path]:
    """The SFT checkpoint, the RL prompts and the held-out questions
    (rlhf_megatron/testing/tools_runs.py), trained at AVX2."""
    root = built_once(tmp_path_factory, "tools_warm_start",
                      lambda root: build_warm_start(root, avx2_head))
    return warm_start_paths(root)
