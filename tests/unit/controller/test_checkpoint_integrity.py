"""Checkpoint manifests (issue 18 item 2): sizes + CRC-32 written before COMPLETE, resume=auto
verifies the newest and falls back with a warning naming the reason, `checkpoints` lists status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_megatron.cli import main
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.records.checkpoint_store import (
    COMPLETE_MARKER,
    MANIFEST_FILE,
    CheckpointStore,
    checkpoint_statuses,
    verify_checkpoint,
)


def _save(store: CheckpointStore, step: int) -> Path:
    tmp = store.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * (40 + step))
    return store.commit(step, tmp, {"step": step})


def test_manifest_lists_every_file_with_size_and_crc(tmp_path):
    path = _save(CheckpointStore(tmp_path, keep_last=0), 1)
    files = json.loads((path / MANIFEST_FILE).read_text())["files"]
    assert set(files) == {"actor/__0_0.distcp", "controller_state.json"}
    assert files["actor/__0_0.distcp"]["size"] == 256 * 41
    assert verify_checkpoint(path) is None
    assert (path / COMPLETE_MARKER).stat().st_mtime_ns >= (path / MANIFEST_FILE).stat().st_mtime_ns


@pytest.mark.parametrize("damage, reason", [
    (lambda f: f.write_bytes(f.read_bytes()[:100]), "has 100 bytes, the manifest says"),
    (lambda f: f.write_bytes(b"\x01" + f.read_bytes()[1:]), "fails its CRC-32 check"),
    (lambda f: f.unlink(), "is missing"),
])
def test_damaged_newest_falls_back_with_the_reason(tmp_path, capsys, damage, reason):
    store = CheckpointStore(tmp_path, keep_last=0)
    older, newest = _save(store, 1), _save(store, 2)
    damage(newest / "actor" / "__0_0.distcp")
    assert store.latest() == newest  # COMPLETE is intact: only the manifest tells
    assert store.resolve_resume("auto") == older
    warning = capsys.readouterr().err
    assert str(newest) in warning and reason in warning and "falling back" in warning
    with pytest.raises(CheckpointError, match=reason):
        store.resolve_resume(str(newest))  # an explicit path is not silently replaced


def test_size_mode_skips_contents_and_all_damaged_is_an_error(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0, verify="size")
    only = _save(store, 1)
    shard = only / "actor" / "__0_0.distcp"
    shard.write_bytes(b"\x01" + shard.read_bytes()[1:])
    assert store.resolve_resume("auto") == only  # same size: passes a size-only check
    shard.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*resume=never"):
        store.resolve_resume("auto")


def test_checkpoints_command_lists_status(tmp_path, capsys):
    run_dir = tmp_path / "run"
    store = CheckpointStore(run_dir / "checkpoints", keep_last=0)
    _save(store, 1)
    bad = _save(store, 2)
    (bad / "actor" / "__0_0.distcp").write_bytes(b"short")
    (run_dir / "checkpoints" / "step_00000003").mkdir()  # no COMPLETE
    rows = checkpoint_statuses(run_dir / "checkpoints")
    assert [(name, status) for name, status, _ in rows] == [
        ("step_00000001", "ok"), ("step_00000002", "damaged"), ("step_00000003", "incomplete")]
    assert main(["checkpoints", str(run_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:2] == ["step_00000002", "damaged"] and "distcp" in out[1]
