"""The base fingerprint an adapter-only LoRA checkpoint records (models/weights_fingerprint.py):
equal for a copy, different for other weights of the same shapes, blind to non-weight files."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.weights_fingerprint import check_base, fingerprint


def _model(path, seed: int, rows: int = 4096):
    path.mkdir()
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(rows, 64, generator=g)}, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def test_a_copy_matches_and_other_weights_do_not(tmp_path):
    base = _model(tmp_path / "base", seed=0)
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    (copy / "config.json").write_text('{"edited": true}')  # not a weight file
    (copy / "rng").mkdir()
    (copy / "rng" / "rank_0.pt").write_bytes(b"x")
    assert fingerprint(copy) == fingerprint(base)
    assert fingerprint(_model(tmp_path / "other", seed=1)) != fingerprint(base)
    # A change past the 64 KiB header, inside one of the sampled blocks, is seen.
    data = bytearray((base / "model.safetensors").read_bytes())
    data[len(data) - 100] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert fingerprint(copy) != fingerprint(base)


def test_check_base_is_one_line_for_another_or_a_missing_base(tmp_path):
    base = _model(tmp_path / "base", seed=0)
    recorded = {"path": str(base), "fingerprint": fingerprint(base)}
    check_base(tmp_path / "ckpt", recorded, base)
    with pytest.raises(CheckpointError, match=r"trained on the base .*base \(sha256:.*is another"):
        check_base(tmp_path / "ckpt", recorded, _model(tmp_path / "other", seed=1))
    with pytest.raises(CheckpointError, match="does not exist"):
        check_base(tmp_path / "ckpt", recorded, tmp_path / "gone")
