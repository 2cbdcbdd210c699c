"""Module-scoped fixtures shared by the controller e2e test files (a module that needs other
assets or another cluster defines its own `assets` / `head`, which take precedence)."""

from __future__ import annotations

from pathlib import Path

import pytest
from controller_harness import RayHead

from rlhf_megatron.quickstart import prepare


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's assets (tiny Llama, tokenizer, addition task), once per module."""
    return prepare(tmp_path_factory.mktemp("quickstart_assets"))


@pytest.fixture(scope="module")
def head():
    """One Ray cluster (4 CPUs) per module that the module's runs join (`run_train(head=...)`),
    instead of a local cluster each. A run that is killed -9 starts its own instead, so that it
    takes its cluster down with it, as a user's would."""
    cluster = RayHead(num_cpus=4)
    yield cluster
    cluster.stop()
