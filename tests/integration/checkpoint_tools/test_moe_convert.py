"""MoE checkpoints through the converter: HF -> Megatron dist-checkpoint -> HF is bit-exact in the
checkpoint's own dtype (per-expert tensors included), and `verify` passes on the result."""

from __future__ import annotations

import pytest
import torch

from checkpoint_tools.__main__ import main
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


# (architecture, dtype, MoE layers of the tiny model): GLM-4.5's and DeepSeek-V3's layer 0 is
# dense, and their router's expert bias stays fp32 in a bf16 checkpoint (HF keeps it so);
# DeepSeek-V3's attention is multi-latent (models/mapping_tables.py `mla_mappings`).
@pytest.mark.parametrize("architecture,dtype,moe_layers", [
    ("Qwen3MoeForCausalLM", torch.bfloat16, 4), ("MixtralForCausalLM", torch.float32, 4),
    ("Glm4MoeForCausalLM", torch.bfloat16, 3), ("Glm4MoeForCausalLM", torch.float32, 3),
    ("DeepseekV3ForCausalLM", torch.bfloat16, 3), ("DeepseekV3ForCausalLM", torch.float32, 3)])
def test_moe_round_trip_is_bit_exact_and_verifies(tmp_path, capsys, architecture, dtype,
                                                  moe_layers):
    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", architecture, dtype=dtype)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt), "--quiet"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet"]) == 0
    source, exported = _tensors(hf_dir), _tensors(out)
    assert exported.keys() == source.keys()
    assert sum(".experts.3." in name for name in source) == moe_layers * 3  # per expert, layer
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert {t.dtype for t in source.values()} >= {dtype}
    if dtype == torch.float32:
        capsys.readouterr()
        assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(ckpt)]) == 0
        assert "OK" in capsys.readouterr().out
