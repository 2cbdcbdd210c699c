"""resume=auto never loses a run silently (issue 28): a newest checkpoint with COMPLETE but an
unreadable controller state is skipped for an older intact one, named in one warning; with none
older the run stops with one line. A state without the loader's position names what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.controller.run import _check_loader_state
from rlhf_megatron.data.prompts import PromptLoader
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.records.checkpoint_store import CONTROLLER_STATE_FILE, CheckpointStore


def _save(store: CheckpointStore, step: int) -> Path:
    tmp = store.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * (4 + step))
    return store.commit(step, tmp, {"step": step})


def _damage_state(path: Path) -> None:
    (path / CONTROLLER_STATE_FILE).write_text('{"step": 2, "loa')  # cut short


def _truncate_shard(path: Path) -> None:
    (path / "actor" / "__0_0.distcp").write_bytes(b"short")


@pytest.mark.parametrize("damage, reason", [(_damage_state, CONTROLLER_STATE_FILE),
                                            (_truncate_shard, "__0_0.distcp has 5 bytes")])
def test_damaged_newest_falls_back_to_the_older_and_names_it(tmp_path, capsys, damage, reason):
    store = CheckpointStore(tmp_path, keep_last=0)
    older, newest = _save(store, 1), _save(store, 2)
    damage(newest)
    assert store.resolve_resume("auto") == older
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines  # one warning, printed once
    assert str(newest) in lines[0] and reason in lines[0]
    assert lines[0].endswith(f"falling back to the older complete checkpoint {older}")


def test_unreadable_state_and_nothing_older_stops_instead_of_starting_over(tmp_path, capsys):
    store = CheckpointStore(tmp_path, keep_last=0)
    only = _save(store, 1)
    _damage_state(only)
    with pytest.raises(CheckpointError) as info:
        store.resolve_resume("auto")
    message = str(info.value)
    assert "\n" not in message and str(only) in message and "resume=never" in message
    assert "falling back" not in capsys.readouterr().err


def test_no_checkpoint_at_all_starts_fresh(tmp_path):
    assert CheckpointStore(tmp_path, keep_last=0).resolve_resume("auto") is None


def test_a_state_without_the_loader_names_the_checkpoint_and_the_entry(tmp_path):
    loader = PromptLoader(list(range(10)), batch_size=2, seed=0)
    path = tmp_path / "step_00000005"
    with pytest.raises(CheckpointError) as info:
        _check_loader_state(loader, {"step": 5}, path)
    assert str(info.value) == (f"cannot resume from {path}: its {CONTROLLER_STATE_FILE} has no "
                               "'loader' entry (the position in the training data)")
