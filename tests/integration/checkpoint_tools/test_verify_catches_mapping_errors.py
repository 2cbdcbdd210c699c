"""`verify`'s tolerance catches a mapping error, not only a different model.

A tiny fp32 Llama is converted with `hf-to-mcore`; `verify` against the same HF files exits 0.
Then the HF side gets the kind of damage a wrong mapping does, one tensor at a time: one layer's
`k_proj` scaled by 1.001, or two query heads of one layer swapped. `verify` must exit 1 with
MISMATCH, the reported log-prob difference above its tolerance. (Llama, not Qwen3: Qwen3's per-head
k norm undoes a scaled k_proj, measured 1.7e-6.)

And on a deep model (30 layers, init scaled so activations and logits are of realistic size:
logit RMS ~3.4), at 512 tokens, where a correct conversion's max |logit diff| (~2.8e-4) is above
the old fixed tolerance of 1e-4: the default passes the correct conversion and fails one
perturbed tensor.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from checkpoint_tools.__main__ import main
from rlhf_megatron.testing.damage import damaged_copy, scale, swap_query_heads
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

HEAD_DIM = 32  # tiny_models: 4 query heads of 32


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("verify")
    hf_dir = write_tiny_hf_checkpoint(root / "hf", "LlamaForCausalLM")
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(root / "ckpt"), "--quiet"]) == 0
    return hf_dir, root / "ckpt"


_scale_k_proj = scale("model.layers.1.self_attn.k_proj.weight", 1.001)


def _verify(hf_dir: Path, ckpt: Path, capsys, *extra: str) -> tuple[int, float, float]:
    capsys.readouterr()
    code = main(["verify", "--hf", str(hf_dir), "--ckpt", str(ckpt), *extra])
    line = capsys.readouterr().out
    found = re.search(r"max \|log-prob diff\| = (\S+) \(tolerance (\S+)\)", line)
    assert found, line
    return code, float(found.group(1)), float(found.group(2))


def test_verify_passes_on_the_source_checkpoint(converted, capsys):
    code, diff, tolerance = _verify(*converted, capsys)
    assert code == 0 and diff <= tolerance


@pytest.mark.parametrize("damage", [_scale_k_proj, swap_query_heads(2, HEAD_DIM)],
                         ids=["k_proj-x1.001", "two-q-heads-swapped"])
def test_verify_exits_1_on_one_damaged_tensor(converted, tmp_path, capsys, damage):
    hf_dir, ckpt = converted
    damaged = damaged_copy(hf_dir, tmp_path / "hf", damage, changed=(1,))
    code, diff, tolerance = _verify(damaged, ckpt, capsys)
    assert code == 1, (diff, tolerance)
    assert diff > tolerance


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> tuple[Path, Path]:
    """A 30-layer fp32 Llama, init range 0.2 and lm_head x1.5 (logit RMS ~3.4), converted."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("verify_deep")
    hf_dir = write_tiny_hf_checkpoint(root / "hf", "LlamaForCausalLM", num_layers=30,
                                      max_position_embeddings=512, initializer_range=0.2)
    weights = load_file(str(hf_dir / "model.safetensors"))
    weights["lm_head.weight"] *= 1.5
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(root / "ckpt"), "--quiet"]) == 0
    return hf_dir, root / "ckpt"


def test_deep_model_at_512_tokens_passes_correct_and_fails_one_perturbed_tensor(deep, tmp_path,
                                                                               capsys):
    from checkpoint_tools.verify import compare

    hf_dir, ckpt = deep
    correct = compare(hf_dir, ckpt, batch=1, seq_len=512)
    assert correct.max_logit_diff > 1e-4, correct.summary()  # the old fixed tolerance failed it
    assert correct.ok and correct.top1_agreement == 1.0, correct.summary()
    damaged = damaged_copy(hf_dir, tmp_path / "hf", _scale_k_proj, changed=(1,))
    code, diff, tolerance = _verify(damaged, ckpt, capsys, "--batch", "1", "--seq-len", "512")
    assert code == 1 and diff > tolerance, (diff, tolerance)
