"""A bf16 model whose norms are stored in fp32 (as many released checkpoints are) converts both
ways bit-exactly: each tensor keeps its own dtype (issue 25, part 4). Casting the minority to the
majority dtype, as the converter did, rounds every fp32 norm weight to bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint_tools.__main__ import main
from checkpoint_tools.common import METADATA_FILE
from checkpoint_tools.mcore_to_hf import read_tensor_metadata
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint


def _tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """A tied bf16 Llama (GQA 6/2) whose norm weights are fp32 values bf16 cannot hold."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("mixed")
    hf_dir = write_tiny_hf_checkpoint(root / "hf", "LlamaForCausalLM", dtype=torch.bfloat16,
                                      tie_word_embeddings=True, num_attention_heads=6,
                                      num_key_value_heads=2, head_dim=32, hidden_size=96)
    weights = _tensors(hf_dir)
    generator = torch.Generator().manual_seed(3)
    for name in [n for n in weights if "norm" in n]:
        weights[name] = 1 + 0.1 * torch.randn(weights[name].shape, generator=generator)
        assert not torch.equal(weights[name], weights[name].bfloat16().float())
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return hf_dir


def test_round_trip_keeps_each_tensors_dtype_and_is_bit_exact(mixed, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(mixed), "--out", str(ckpt), "--quiet"]) == 0
    assert json.loads((ckpt / METADATA_FILE).read_text())["dtype"] == "bf16"  # the majority
    stored = read_tensor_metadata(ckpt)
    # The fused layer_norm_weight of linear_qkv / linear_fc1, and final_layernorm.
    norms = {key: dtype for key, (_, dtype) in stored.items() if "norm" in key}
    assert norms and set(norms.values()) == {torch.float32}, norms
    assert {dtype for key, (_, dtype) in stored.items() if key not in norms} == {torch.bfloat16}
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet"]) == 0
    source, exported = _tensors(mixed), _tensors(out)
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    # An explicit --dtype still casts everything.
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "bf16"), "--quiet",
                 "--dtype", "bf16"]) == 0
    assert {t.dtype for t in _tensors(tmp_path / "bf16").values()} == {torch.bfloat16}


def test_mixed_checkpoint_verifies_in_fp32_and_loads_into_a_bf16_model(mixed, tmp_path):
    from checkpoint_tools.verify import compare

    ckpt = tmp_path / "ckpt"
    assert main(["hf-to-mcore", "--hf", str(mixed), "--out", str(ckpt), "--quiet"]) == 0
    result = compare(mixed, ckpt, batch=1, seq_len=64, compute_dtype="bf16")
    assert result.ok and result.dtype_check is not None, result.summary()
    assert result.logprob_tolerance < 1e-4, result.summary()
