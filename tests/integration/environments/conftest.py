"""The tools quickstart's SFT warm start, built once per pytest run for both GRPO files
(test_episodes_e2e.py, sync; test_episodes_async_e2e.py, async): under pytest-xdist the two files
run on different workers, and the second waits for the first's build instead of repeating it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.testing.fixtures import built_once
from rlhf_megatron.testing.tools_runs import build_warm_start, warm_start_paths
from rlhf_megatron.testing.train_runs import RayHead


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory: pytest.TempPathFactory, head: RayHead) -> dict[str, Path]:
    """The SFT checkpoint, the RL prompts and the held-out questions
    (rlhf_megatron/testing/tools_runs.py)."""
    root = built_once(tmp_path_factory, "tools_warm_start",
                      lambda root: build_warm_start(root, head))
    return warm_start_paths(root)
