"""`built_once` (rlhf_megatron/testing/fixtures.py): one build per pytest run, shared by the xdist
workers that ask for it, and a failed build is not mistaken for a finished one."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from rlhf_megatron.testing.fixtures import built_once


class _Factory:  # the part of pytest's TempPathFactory that built_once reads
    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def _slow_build(root: Path) -> None:
    (root.parent / f"build_{time.monotonic_ns()}").touch()  # one mark per build
    time.sleep(0.5)
    (root / "artifact").write_text("built")


def _ask(run_dir: str, worker: str) -> None:
    import os

    os.environ["PYTEST_XDIST_WORKER"] = worker
    root = built_once(_Factory(Path(run_dir) / f"popen-{worker}"), "thing", _slow_build)
    assert (root / "artifact").read_text() == "built"


def test_two_workers_share_one_build(tmp_path):
    for worker in ("gw0", "gw1"):
        (tmp_path / f"popen-{worker}").mkdir()
    askers = [mp.get_context("spawn").Process(target=_ask, args=(str(tmp_path), w))
              for w in ("gw0", "gw1")]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join(60)
    assert [a.exitcode for a in askers] == [0, 0]
    assert len(list(tmp_path.glob("build_*"))) == 1  # the second worker waited, then reused it


def test_a_failed_build_is_built_again(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)

    def failing(root: Path) -> None:
        (root / "half").touch()
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        built_once(_Factory(tmp_path), "thing", failing)
    root = built_once(_Factory(tmp_path), "thing", _slow_build)
    assert sorted(p.name for p in root.iterdir()) == [".done", "artifact"]  # the half is gone
