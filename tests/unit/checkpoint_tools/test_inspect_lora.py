"""`rlhf-convert inspect`'s lines for a LoRA checkpoint (checkpoint_tools/inspect_cmd.py): the
settings with their scale, and whether the recorded base is still there and still the same."""

from __future__ import annotations

from checkpoint_tools.inspect_cmd import _base_line, _lora_lines
from rlhf_megatron.models.weights_fingerprint import fingerprint


def _base(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 400)
    return base, {"path": str(base), "fingerprint": fingerprint(base)}


def test_base_line_tells_a_matching_a_changed_and_a_missing_base(tmp_path):
    base, recorded = _base(tmp_path)
    assert _base_line(recorded).endswith("; present, fingerprint matches)")
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 401)
    changed = _base_line(recorded)
    assert f"; present, but its fingerprint is now {fingerprint(base)[:19]}: another base)" in changed
    assert changed.startswith(f"base (not stored): {base} ({recorded['fingerprint'][:19]};")
    (base / "model.safetensors").unlink()
    base.rmdir()
    assert _base_line(recorded).endswith("; not found on this machine)")


def test_lora_lines_give_the_scale_and_the_base_only_when_recorded(tmp_path):
    lora = {"rank": 8, "alpha": 16.0, "dropout": 0.05, "target_modules": ["linear_qkv", "linear_fc2"]}
    assert _lora_lines(lora, None) == [
        "LoRA: rank 8, alpha 16 (scale 2), dropout 0.05, on linear_qkv, linear_fc2"]
    _, recorded = _base(tmp_path)
    assert len(_lora_lines(lora, recorded)) == 2
