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


# HF expert tensors of the last of 4 experts, per MoE layer: gate, up and down per expert; gpt-oss
# keeps a layer's experts in 4 fused tensors (gate_up_proj, its bias, down_proj, its bias).
PER_EXPERT = (".experts.3.", 3)
FUSED = (".mlp.experts.", 4)


# (architecture, dtype, MoE layers of the tiny model, expert tensors): GLM-4.5's and
# DeepSeek-V3's layer 0 is dense, and their router's expert bias stays fp32 in a bf16 checkpoint
# (HF keeps it so); DeepSeek-V3's attention is multi-latent (models/mapping_tables.py
# `mla_mappings`); gpt-oss's experts are fused with gate/up interleaved and biased, its attention
# has sinks (models/gpt_oss_mapping.py).
@pytest.mark.parametrize("architecture,dtype,moe_layers,expert_tensors", [
    ("Qwen3MoeForCausalLM", torch.bfloat16, 4, PER_EXPERT),
    ("MixtralForCausalLM", torch.float32, 4, PER_EXPERT),
    ("Glm4MoeForCausalLM", torch.bfloat16, 3, PER_EXPERT),
    ("Glm4MoeForCausalLM", torch.float32, 3, PER_EXPERT),
    ("DeepseekV3ForCausalLM", torch.bfloat16, 3, PER_EXPERT),
    ("DeepseekV3ForCausalLM", torch.float32, 3, PER_EXPERT),
    ("GptOssForCausalLM", torch.bfloat16, 4, FUSED),
    ("GptOssForCausalLM", torch.float32, 4, FUSED)])
def test_moe_round_trip_is_bit_exact_and_verifies(tmp_path, capsys, architecture, dtype,
                                                  moe_layers, expert_tensors):
    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", architecture, dtype=dtype)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt), "--quiet"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet"]) == 0
    source, exported = _tensors(hf_dir), _tensors(out)
    assert exported.keys() == source.keys()
    marker, per_layer = expert_tensors
    assert sum(marker in name for name in source) == moe_layers * per_layer
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert {t.dtype for t in source.values()} >= {dtype}
    if dtype == torch.float32:
        capsys.readouterr()
        assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(ckpt)]) == 0
        assert "OK" in capsys.readouterr().out
