"""pytest fixtures shared by test modules; tests/conftest.py registers this module as a plugin,
so a test module asks for one by name (`pytestmark = pytest.mark.usefixtures("repo_cwd")`)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout the tests run from


@pytest.fixture
def repo_cwd(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test in the repository root: paths in configs/ (config_json, data files) are
    relative to it."""
    monkeypatch.chdir(REPO_ROOT)
    return REPO_ROOT


def run_temp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pytest run's own temporary directory, shared by its xdist workers (a worker's basetemp
    is a child of it; without xdist it is the basetemp itself)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str,
               build: Callable[[Path], None]) -> Path:
    """A directory that `build` fills once per pytest run, whichever xdist worker asks first;
    the others wait on a lock for it. A build that fails leaves nothing marked done, so the next
    asker builds it again (and fails on its own)."""
    root = run_temp_root(tmp_path_factory) / f"built_once_{name}"
    done = root / ".done"
    with root.with_suffix(".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            build(root)
            done.touch()
    return root
