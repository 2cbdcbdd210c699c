"""`python -m checkpoint_tools`: round trips through files and the bad-input cases.

HF -> dist-checkpoint -> HF is bit-exact for every tensor; `verify` runs Megatron at TP=PP=1 and
TP=2/PP=2 on the converted files; bad input is one line on stderr, exit 2, no traceback and no
output left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint_tools.__main__ import main
from checkpoint_tools.common import METADATA_FILE
from rlhf_megatron.testing.hf_reference import hf_model, hf_token_logprobs
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

REPO = Path(__file__).resolve().parents[3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "checkpoint_tools", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def _tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _assert_no_leftovers(out: Path) -> None:
    assert not out.exists(), f"{out} was left behind"
    assert not list(out.parent.glob(f".{out.name}.tmp-*")), "a temp dir was left behind"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    """A sharded Qwen3 (q/k norm) HF dir and its dist-checkpoint, made by the CLI."""
    root = tmp_path_factory.mktemp("cli")
    hf_dir = write_tiny_hf_checkpoint(root / "hf", "Qwen3ForCausalLM", max_shard_size="300KB")
    result = _cli("hf-to-mcore", "--hf", str(hf_dir), "--out", str(root / "ckpt"), "--tp", "2")
    assert result.returncode == 0, result.stderr
    assert "peak RSS" in result.stdout
    return hf_dir, root / "ckpt"


@pytest.mark.multirank
def test_cli_round_trip_is_bit_exact_and_verifies(converted, tmp_path):
    hf_dir, ckpt = converted
    assert json.loads((ckpt / METADATA_FILE).read_text())["padded_vocab_size"] == 512  # 128 * tp2
    out = tmp_path / "hf_out"
    result = _cli("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--max-shard-size", "500KB")
    assert result.returncode == 0, result.stderr
    source, exported = _tensors(hf_dir), _tensors(out)
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    assert len(list(out.glob("*.safetensors"))) > 1
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "model.safetensors.index.json"):
        assert (out / name).is_file(), name
    for tp, pp in [(1, 1), (2, 2)]:
        result = _cli("verify", "--hf", str(out), "--ckpt", str(ckpt), "--tp", str(tp),
                      "--pp", str(pp))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "OK" in result.stdout
    for target, expected in [(hf_dir, "HF checkpoint"), (ckpt, "Megatron dist-checkpoint")]:
        result = _cli("inspect", str(target))
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout and "Qwen3ForCausalLM" in result.stdout
        assert "parameters: " in result.stdout


def test_tied_bf16_round_trip_in_process(tmp_path, capsys):
    import transformers

    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", "Qwen2ForCausalLM", tie_word_embeddings=True)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt), "--dtype", "bf16",
                 "--quiet"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet"]) == 0
    source, exported = _tensors(hf_dir), _tensors(out)
    assert "lm_head.weight" not in exported and exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert len(transformers.AutoTokenizer.from_pretrained(str(out))) == len(
        transformers.AutoTokenizer.from_pretrained(str(hf_dir)))
    # An existing output is refused without --force and replaced with it.
    capsys.readouterr()
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet", "--force"]) == 0
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_bf16_gqa3_tied_round_trip_keeps_dtype_and_is_bit_exact_by_default(tmp_path):
    """No --dtype: bf16 stays bf16 both ways, every tensor and config.json come back unchanged,
    and an fp32 engine loads the bf16 checkpoint (cast at load) with HF's fp32 logprobs."""
    from checkpoint_tools.common import single_rank_group
    from checkpoint_tools.mcore_to_hf import read_tensor_metadata
    from rlhf_megatron.engines import EngineConfig, ReferenceEngine
    from rlhf_megatron.parallel import ParallelDims

    hf_dir = write_tiny_hf_checkpoint(
        tmp_path / "hf", "Qwen3ForCausalLM", tie_word_embeddings=True, dtype=torch.bfloat16,
        num_attention_heads=6, num_key_value_heads=2, head_dim=32)  # GQA ratio 3
    # Written as transformers < 5 does (`torch_dtype`), compactly: kept byte for byte.
    fields = json.loads((hf_dir / "config.json").read_text())
    fields["torch_dtype"] = fields.pop("dtype")
    (hf_dir / "config.json").write_text(json.dumps(fields))
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt), "--quiet"]) == 0
    assert json.loads((ckpt / METADATA_FILE).read_text())["dtype"] == "bf16"
    stored = read_tensor_metadata(ckpt)
    assert {dtype for _, dtype in stored.values()} == {torch.bfloat16}, stored
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet"]) == 0
    source, exported = _tensors(hf_dir), _tensors(out)
    assert exported.keys() == source.keys() and "lm_head.weight" not in exported
    for name, tensor in source.items():
        assert tensor.dtype == torch.bfloat16 and exported[name].dtype == torch.bfloat16, name
        assert torch.equal(exported[name], tensor), name
    assert (out / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()
    size = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in out.glob("*.safetensors")) < 1.05 * size

    tokens = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = hf_token_logprobs(hf_model(hf_dir), tokens)[:, 1:]
    with single_rank_group():
        engine = ReferenceEngine(EngineConfig(micro_batch_size=2), hf_dir=ckpt,
                                 dims=ParallelDims(1))
        assert engine.config.params_dtype == torch.float32
        batch = _token_batch(tokens)
        logprobs = engine.compute_logprobs(batch)["logprobs"]
    assert (logprobs[:, 1:] - expected).abs().max().item() < 1e-5


def _token_batch(tokens: torch.Tensor):
    from rlhf_megatron.data.batch import TokenBatch

    ones = torch.ones_like(tokens)
    return TokenBatch(tokens, ones, ones.clone(), {})


def _edit_json(path: Path, **changes) -> None:
    fields = json.loads(path.read_text())
    fields.update(changes)
    path.write_text(json.dumps(fields))


def _sharded_llama(tmp_path: Path, **overrides) -> Path:
    return write_tiny_hf_checkpoint(tmp_path / "hf", "LlamaForCausalLM", max_shard_size="300KB",
                                    **overrides)


def _bad_unsupported(tmp_path, converted):
    hf = _sharded_llama(tmp_path)
    _edit_json(hf / "config.json", architectures=["GPT2LMHeadModel"])
    return ["hf-to-mcore", "--hf", str(hf)], "unsupported architecture 'GPT2LMHeadModel'"


def _bad_missing_file(tmp_path, converted):
    hf = _sharded_llama(tmp_path)
    victim = sorted(hf.glob("*.safetensors"))[1]
    victim.unlink()
    return ["hf-to-mcore", "--hf", str(hf)], f"missing safetensors file {victim}"


def _bad_corrupt_file(tmp_path, converted):
    hf = _sharded_llama(tmp_path)
    victim = sorted(hf.glob("*.safetensors"))[2]
    victim.write_bytes(victim.read_bytes()[:100])
    return ["hf-to-mcore", "--hf", str(hf)], f"corrupt safetensors file {victim}"


def _bad_shape(tmp_path, converted):
    hf = _sharded_llama(tmp_path)
    _edit_json(hf / "config.json", intermediate_size=512)
    return (["hf-to-mcore", "--hf", str(hf)],
            "'model.layers.0.mlp.gate_proj.weight' in model-")  # + both shapes, checked below


def _bad_tp_heads(tmp_path, converted):
    return (["hf-to-mcore", "--hf", str(_sharded_llama(tmp_path)), "--tp", "3"],
            "num_attention_heads=4 is not divisible by tp=3")


def _bad_tp_kv_heads(tmp_path, converted):
    return (["hf-to-mcore", "--hf", str(_sharded_llama(tmp_path)), "--tp", "4"],
            "num_key_value_heads=2 is not divisible by tp=4")


def _bad_tp_ffn(tmp_path, converted):
    return (["hf-to-mcore", "--hf", str(_sharded_llama(tmp_path, intermediate_size=255)),
             "--tp", "2"], "intermediate_size=255 is not divisible by tp=2")


def _bad_tp_vocab(tmp_path, converted):
    hf_dir, ckpt = converted
    fake = tmp_path / "ckpt"
    shutil.copytree(ckpt, fake)
    _edit_json(fake / METADATA_FILE, padded_vocab_size=301)
    return (["verify", "--hf", str(hf_dir), "--ckpt", str(fake), "--tp", "2"],
            "padded vocabulary (301) is not divisible by tp=2")


def _bad_output_exists(tmp_path, converted):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    return (["mcore-to-hf", "--ckpt", str(converted[1])],
            "exists and is not empty; pass --force")


def _bad_metadata_architecture(tmp_path, converted):
    fake = tmp_path / "ckpt"
    shutil.copytree(converted[1], fake)
    _edit_json(fake / METADATA_FILE, architecture="GPT2LMHeadModel")
    return ["mcore-to-hf", "--ckpt", str(fake)], "unsupported architecture 'GPT2LMHeadModel'"


def _bad_other_architecture(tmp_path, converted):
    return (["verify", "--hf", str(_sharded_llama(tmp_path)), "--ckpt", str(converted[1])],
            "holds Qwen3ForCausalLM, but")


def _bad_peft_without_adapters(tmp_path, converted):
    return (["lora-to-peft", "--ckpt", str(converted[1])],
            "holds no LoRA adapters (its metadata has no lora settings)")


def _bad_merge_without_adapters(tmp_path, converted):
    return (["mcore-to-hf", "--ckpt", str(converted[1]), "--merge-lora"],
            "--merge-lora: ")


BAD_INPUTS = [_bad_unsupported, _bad_missing_file, _bad_corrupt_file, _bad_shape, _bad_tp_heads,
              _bad_tp_kv_heads, _bad_tp_ffn, _bad_tp_vocab, _bad_output_exists,
              _bad_metadata_architecture, _bad_other_architecture, _bad_peft_without_adapters,
              _bad_merge_without_adapters]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.__name__[5:] for c in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(case, tmp_path, converted, capsys):
    argv, expected = case(tmp_path, converted)
    out = tmp_path / "out"
    existed = out.exists()
    if argv[0] != "verify":
        argv += ["--out", str(out), "--quiet"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    assert expected in err, err
    assert "Traceback" not in err
    if case is _bad_shape:
        assert "(256, 128)" in err and "(512, 128)" in err
    if not existed:
        _assert_no_leftovers(out)
    else:
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_unsupported_architecture_subprocess_lists_supported_and_no_traceback(tmp_path, converted):
    args, _ = _bad_unsupported(tmp_path, converted)
    result = _cli(*args, "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in lines[0]
    _assert_no_leftovers(tmp_path / "out")


def test_verify_exits_1_when_the_weights_differ(tmp_path, converted, capsys):
    other = write_tiny_hf_checkpoint(tmp_path / "other", "Qwen3ForCausalLM", seed=1)
    capsys.readouterr()
    assert main(["verify", "--hf", str(other), "--ckpt", str(converted[1])]) == 1
    assert "MISMATCH" in capsys.readouterr().out
