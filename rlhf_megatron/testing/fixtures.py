"""pytest fixtures shared by test modules; tests/conftest.py registers this module as a plugin,
so a test module asks for one by name (`pytestmark = pytest.mark.usefixtures("repo_cwd")`)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout the tests run from


@pytest.fixture
def repo_cwd(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test in the repository root: paths in configs/ (config_json, data files) are
    relative to it."""
    monkeypatch.chdir(REPO_ROOT)
    return REPO_ROOT
