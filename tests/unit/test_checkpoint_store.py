"""CheckpointStore: commit protocol, crash safety (simulated and a real kill -9), pruning and
resume resolution."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_megatron.errors import CheckpointError, ConfigError
from rlhf_megatron.records.checkpoint_store import CheckpointStore, checkpoint_step

REPO_ROOT = Path(__file__).resolve().parents[2]


def _save(store, step, payload=b"weights"):
    tmp = store.begin(step)
    (tmp / "model").mkdir()
    (tmp / "model" / "shard_0.bin").write_bytes(payload)
    return store.commit(step, tmp, {"step": step, "consumed_samples": 8 * step})


def test_commit_layout_and_latest(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=0)
    assert store.latest() is None
    tmp = store.begin(10)
    assert tmp.name == f".tmp-step_00000010-{os.getpid()}" and tmp.is_dir()
    (tmp / "shard").write_bytes(b"x")
    final = store.commit(10, tmp, {"step": 10})
    assert final == tmp_path / "checkpoints" / "step_00000010"
    assert sorted(p.name for p in final.iterdir()) == ["COMPLETE", "MANIFEST.json",
                                                     "controller_state.json", "shard"]
    assert not tmp.exists()
    assert store.latest() == final and checkpoint_step(final) == 10
    assert store.load_controller_state(final) == {"step": 10}


def test_simulated_crash_between_begin_and_commit_keeps_previous(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    first = _save(store, 1)
    tmp = store.begin(2)
    (tmp / "model").mkdir()
    (tmp / "model" / "shard_0.bin").write_bytes(b"half")
    (tmp / "controller_state.json").write_text('{"step": 2, "trunc')  # crashed mid-write
    assert store.latest() == first
    assert store.cleanup_stale() == [tmp] and not tmp.exists()
    assert store.latest() == first


def test_incomplete_or_corrupt_final_dirs_are_ignored(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    first = _save(store, 1)
    (tmp_path / "step_00000005").mkdir()  # no COMPLETE
    corrupt = tmp_path / "step_00000006"
    corrupt.mkdir()
    (corrupt / "COMPLETE").write_text("6\n")
    (corrupt / "controller_state.json").write_text("{not json")
    assert store.latest() == first
    with pytest.raises(CheckpointError, match="controller_state.json"):
        store.load_controller_state(corrupt)


def test_kill_9_while_writing_keeps_previous_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    first = _save(store, 1)
    writer = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from rlhf_megatron.records.checkpoint_store import CheckpointStore\n"
        "tmp = CheckpointStore(Path(sys.argv[1]), keep_last=2).begin(2)\n"
        "with open(tmp / 'big.bin', 'wb') as f:\n"
        "    for i in range(100000):\n"
        "        f.write(b'\\0' * 65536); f.flush()\n"
        "        if i == 4: print(tmp, flush=True)\n"
        "        time.sleep(0.005)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", writer, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        tmp = Path(proc.stdout.readline().strip())
        assert tmp.name.startswith(".tmp-step_00000002-") and (tmp / "big.bin").stat().st_size > 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert store.latest() == first
    assert store.load_controller_state(store.latest()) == {"step": 1, "consumed_samples": 8}
    assert store.cleanup_stale() == [tmp]
    second = _save(store, 2)
    assert store.latest() == second


def test_pruning_keeps_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        _save(store, step)
    assert [p.name for p in store.complete_checkpoints()] == ["step_00000003", "step_00000004"]
    assert not list(tmp_path.glob(".tmp-*"))
    keep_all = CheckpointStore(tmp_path, keep_last=0)
    _save(keep_all, 5)
    assert len(keep_all.complete_checkpoints()) == 3


def test_pruning_never_deletes_the_checkpoint_just_committed(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=1)
    _save(store, 9)  # e.g. left by an abandoned timeline after resuming from an older step
    committed = _save(store, 3)
    assert committed.is_dir() and store.latest() == tmp_path / "step_00000009"


def test_recommit_same_step_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    _save(store, 3, payload=b"old")
    final = _save(store, 3, payload=b"new")
    assert (final / "model" / "shard_0.bin").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000003"]


def test_begin_removes_stale_temp_of_same_step(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    stale = tmp_path / ".tmp-step_00000004-999999"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("x")
    other = tmp_path / ".tmp-step_00000005-999999"
    other.mkdir()
    tmp = store.begin(4)
    assert not stale.exists() and other.exists() and not any(tmp.iterdir())


def test_resolve_resume(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep_last=0)
    assert store.resolve_resume("auto") is None
    assert store.resolve_resume("never") is None and store.resolve_resume("") is None
    first = _save(store, 1)
    second = _save(store, 2)
    assert store.resolve_resume("auto") == second
    assert store.resolve_resume(str(first)) == first
    with pytest.raises(ConfigError, match="nowhere") as info:
        store.resolve_resume(str(tmp_path / "nowhere"))
    assert "\n" not in str(info.value)
    (first / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match="step_00000001"):
        store.resolve_resume(str(first))


def test_controller_state_is_json(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    final = _save(store, 7)
    assert json.loads((final / "controller_state.json").read_text())["consumed_samples"] == 56
