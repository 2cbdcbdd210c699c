"""Memory bounds of checkpoint handling, asserted (they used to be printed only).

On a Llama-shaped fp32 model wide enough to tell a whole model from one rank's shard (196 MB;
largest HF tensor 8 MB, largest Megatron tensor fc1 = gate + up, 16 MB), peak RSS above the RSS
just before each phase (Linux `VmHWM`, reset through /proc/self/clear_refs, so imports and the
runtime are not counted):

- direct load into TP=2 shards (`load_hf_into_model`): at least the rank's shard (the
  measurement sees the weights arrive), at most the shard plus a quarter of the model (measured:
  shard + 4..15 MB); and the bytes it reads through read(2) (/proc/self/io) are at most its shard:
  each rank reads only its slices (the column slices go through a mapped file instead);
- `hf-to-mcore` keeping the dtype (in-kernel copies, `checkpoint_tools/byte_copy.py`): at most
  2x the largest HF tensor (measured ~1 MB: no tensor byte passes through user space);
- `hf-to-mcore --dtype bf16` (a cast: the streaming save through user space): at least the
  largest HF tensor (the measurement sees the weights), at most 4x the largest Megatron tensor
  + 16 MB (measured 3.3x in fp32: fc1, its gate and up, and the chunk being written), under half
  the model.

Both run in one 2-rank job: rank 0 converts first (after a warm-up conversion of a 1 MB model),
then both ranks load.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rlhf_megatron.testing.multirank import run_on_ranks

MB = 1 << 20
WIDE = dict(vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
            num_key_value_heads=4, head_dim=128, num_layers=5)
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_layers=1)
CONVERT_ALLOWANCE_MB = 16  # torch's serialization buffers, metadata


def _generate(hf_dir: Path, dims: dict) -> tuple[int, int]:
    """A random Llama checkpoint written tensor by tensor; (total bytes, largest tensor bytes)."""
    from checkpoint_tools.safetensors_writer import (
        PlannedSafetensorsWriter,
        PlannedTensor,
        assign_shards,
    )
    from rlhf_megatron.models.hf_checkpoint import expected_hf_shapes
    from rlhf_megatron.testing.tiny_models import tiny_hf_config, train_tiny_tokenizer

    hf_dir.mkdir(parents=True)
    train_tiny_tokenizer(hf_dir)
    config = tiny_hf_config("LlamaForCausalLM", **dims)
    config.save_pretrained(str(hf_dir))
    plan = [PlannedTensor(n, tuple(s), torch.float32) for n, s in expected_hf_shapes(config).items()]
    writer = PlannedSafetensorsWriter(hf_dir, assign_shards(plan, 100 * MB))
    generator = torch.Generator().manual_seed(0)
    for entry in plan:
        writer.write(entry.name, torch.randn(entry.shape, generator=generator) * 0.02)
    writer.close()
    return sum(e.nbytes for e in plan), max(e.nbytes for e in plan)


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _peak_above_now_mb(run) -> float:
    """Peak RSS while `run()` runs, above the RSS just before it (MB)."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS (Linux >= 4.0)
    baseline = _rss_mb("VmRSS")
    run()
    return _rss_mb("VmHWM") - baseline


def _convert(hf_dir: str, tiny_dir: str, out_dir: str) -> dict[str, float]:
    """hf-to-mcore in this process: a warm-up on the 1 MB model, then the measured ones, keeping
    the dtype ("kernel") and casting to bf16 ("cast")."""
    from checkpoint_tools.__main__ import main

    saved = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                        "WORLD_SIZE")}
    try:  # the CLI makes its own process group of one
        assert main(["hf-to-mcore", "--hf", tiny_dir, "--out", f"{out_dir}/ckpt_tiny", "--quiet"]) == 0
        return {"kernel": _peak_above_now_mb(lambda: main(
                    ["hf-to-mcore", "--hf", hf_dir, "--out", f"{out_dir}/ckpt_wide", "--quiet"])),
                "cast": _peak_above_now_mb(lambda: main(
                    ["hf-to-mcore", "--hf", hf_dir, "--out", f"{out_dir}/ckpt_bf16", "--quiet",
                     "--dtype", "bf16"]))}
    finally:
        os.environ.update(saved)


def _direct_load(hf_dir: str) -> dict:
    import dataclasses

    from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
    from rlhf_megatron.models.hf_checkpoint import load_hf_config
    from rlhf_megatron.models.hf_load import load_hf_into_model
    from rlhf_megatron.parallel import ParallelDims, parallel_layout

    config = load_hf_config(hf_dir)
    dims = ParallelDims(2, tp=2)
    chunks = []
    with parallel_layout(dims):
        args = hf_to_megatron_args(config, ARCHITECTURES.for_hf_config(config), dims)
        # As an engine starting from HF: no random init of weights that are then overwritten.
        no_init = dataclasses.replace(args.transformer_config, perform_initialization=False)
        args = dataclasses.replace(args, transformer_config=no_init)

        read = {}

        def build_and_load() -> None:
            chunks.extend(build_model_chunks(args))
            read["before"] = _bytes_read()
            load_hf_into_model(chunks, hf_dir, args)
            read["after"] = _bytes_read()

        above = _peak_above_now_mb(build_and_load)
    shard = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    return {"above_mb": above, "shard_mb": shard / MB,
            "read_mb": (read["after"] - read["before"]) / MB}


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and friends (/proc/self/io `rchar`)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _fixed_mmap_threshold() -> None:
    """glibc raises its mmap threshold each time a big block is freed, after which freed tensors
    stay resident in the heap and the measure depends on allocation history; a fixed 1 MB
    threshold hands every freed tensor back, so RSS follows the memory really held."""
    import ctypes

    m_mmap_threshold = -3
    assert ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 1 << 20) == 1


def _memory_job(hf_dir: str, tiny_dir: str, out_dir: str) -> dict:
    from rlhf_megatron.parallel import initialize_distributed

    _fixed_mmap_threshold()
    result = {}
    if os.environ["RANK"] == "0":
        result["convert_above_mb"] = _convert(hf_dir, tiny_dir, out_dir)
    initialize_distributed()  # rank 1 waits here for rank 0's conversion
    result.update(_direct_load(hf_dir))
    return result


@pytest.mark.multirank
def test_peak_memory_of_direct_load_and_conversion_is_bounded(tmp_path):
    total, largest = _generate(tmp_path / "wide", WIDE)
    _generate(tmp_path / "tiny", TINY)
    model_mb, largest_mb = total / MB, largest / MB
    per_rank = run_on_ranks(_memory_job, 2, (str(tmp_path / "wide"), str(tmp_path / "tiny"),
                                             str(tmp_path)), timeout_s=600, init_distributed=False)
    largest_megatron_mb = 2 * WIDE["intermediate_size"] * WIDE["hidden_size"] * 4 / MB  # fc1
    for rank, result in enumerate(per_rank):
        shard, above = result["shard_mb"], result["above_mb"]
        assert shard < 0.55 * model_mb, result  # a TP=2 shard is about half the model
        load_bound = shard + 0.25 * model_mb
        assert 0.9 * shard <= above <= load_bound, (
            f"rank {rank}: direct load peaked {above:.0f} MB above its baseline; shard "
            f"{shard:.0f} MB, model {model_mb:.0f} MB, bound {load_bound:.0f} MB"
        )
        assert result["read_mb"] <= shard + 1, f"rank {rank} read more than its shard: {result}"
    convert_bound = 4 * largest_megatron_mb + CONVERT_ALLOWANCE_MB
    assert convert_bound < 0.5 * model_mb  # wide enough to tell streaming from a whole model
    above = per_rank[0]["convert_above_mb"]
    assert above["kernel"] <= 2 * largest_mb, (
        f"hf-to-mcore (dtype kept, in-kernel copies) peaked {above['kernel']:.0f} MB above its "
        f"baseline; largest HF tensor {largest_mb:.0f} MB"
    )
    assert largest_mb <= above["cast"] <= convert_bound, (
        f"hf-to-mcore --dtype bf16 peaked {above['cast']:.0f} MB above its baseline; model "
        f"{model_mb:.0f} MB, largest Megatron tensor {largest_megatron_mb:.0f} MB, bound "
        f"{convert_bound:.0f} MB"
    )
