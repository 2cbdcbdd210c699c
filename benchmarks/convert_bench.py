"""Converter benchmark: a generated ~1.2 GB fp32 Llama-shaped checkpoint, both ways.

    .venv/bin/python benchmarks/convert_bench.py [--layers 4] [--workdir /tmp/convert_bench]

Prints, for hf-to-mcore, mcore-to-hf and the direct load into TP=2 shards: time (after imports),
GB/s, the ratio to a plain file copy of the same checkpoint (`shutil.copytree`, in-kernel) and to
a read + write of the same files through user space, both measured in the same run, peak RSS,
and peak RSS over the largest single tensor (raw, and above the same phase run on a 1 MB model,
i.e. without the constant cost of imports and runtime). Each phase runs in its own process(es).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # checkpoint_tools, also when the editable install predates it
GB = 1e9


BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
           num_key_value_heads=4, head_dim=128)
# Same code paths at ~1 MB: its peak RSS is the constant (imports, runtime) of each phase.
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def generate(hf_dir: Path, layers: int, dims: dict) -> tuple[int, int]:
    """Write the checkpoint tensor by tensor (never the whole model in RAM).
    Returns (total bytes, largest tensor bytes)."""
    from checkpoint_tools.safetensors_writer import (
        PlannedSafetensorsWriter,
        PlannedTensor,
        assign_shards,
    )
    from rlhf_megatron.models.hf_checkpoint import expected_hf_shapes
    from rlhf_megatron.testing.tiny_models import tiny_hf_config, train_tiny_tokenizer

    hf_dir.mkdir(parents=True)
    train_tiny_tokenizer(hf_dir)
    config = tiny_hf_config("LlamaForCausalLM", num_layers=layers, max_position_embeddings=512,
                            **dims)
    config.save_pretrained(str(hf_dir))
    plan = [PlannedTensor(n, tuple(s), torch.float32) for n, s in expected_hf_shapes(config).items()]
    writer = PlannedSafetensorsWriter(hf_dir, assign_shards(plan, 500 * 10**6))
    generator = torch.Generator().manual_seed(0)
    for entry in plan:
        writer.write(entry.name, torch.randn(entry.shape, generator=generator) * 0.02)
    writer.close()
    return sum(e.nbytes for e in plan), max(e.nbytes for e in plan)


def _run(args: list[str]) -> tuple[float, float, float]:
    """(wall seconds, conversion seconds and peak RSS MB of the child, as printed by the CLI)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                            text=True)
    seconds = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{args} failed:\n{result.stderr[-3000:]}")
    rss = re.search(r"peak RSS (\d+) MB", result.stdout)
    inner = re.search(r"in ([\d.]+) s;", result.stdout)
    return seconds, float(inner.group(1)) if inner else seconds, float(rss.group(1))


def _userspace_copy(src: Path, dst: Path) -> float:
    """Seconds to read each file into a fresh buffer and write it out (one user-space copy each
    way, as any converter that looks at the bytes must): the floor for the conversions."""
    dst.mkdir()
    start = time.perf_counter()
    for path in sorted(src.iterdir()):
        buffer = torch.empty(path.stat().st_size, dtype=torch.uint8)
        with open(path, "rb") as source, open(dst / path.name, "wb") as sink:
            source.readinto(memoryview(buffer.numpy()))
            sink.write(memoryview(buffer.numpy()))
    return time.perf_counter() - start


def _direct_load_rank(hf_dir: str) -> tuple[float, float]:
    from checkpoint_tools.common import peak_rss_mb
    from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
    from rlhf_megatron.models.hf_checkpoint import load_hf_config
    from rlhf_megatron.models.hf_load import load_hf_into_model
    from rlhf_megatron.parallel import ParallelDims, parallel_layout

    config = load_hf_config(hf_dir)
    with parallel_layout(ParallelDims(2, tp=2)):
        args = hf_to_megatron_args(config, ARCHITECTURES.for_hf_config(config), ParallelDims(2, tp=2))
        # As a trainer starting from HF would: no random init of weights that are overwritten.
        no_init = dataclasses.replace(args.transformer_config, perform_initialization=False)
        args = dataclasses.replace(args, transformer_config=no_init)
        chunks = build_model_chunks(args)
        start = time.perf_counter()
        load_hf_into_model(chunks, hf_dir, args)
        seconds = time.perf_counter() - start
    return seconds, peak_rss_mb()


def _phases(work: Path, hf_dir: Path) -> dict[str, tuple[float, float, float]]:
    """name -> (wall s, conversion s, peak RSS MB) for each phase on `hf_dir`."""
    from rlhf_megatron.testing.multirank import run_on_ranks

    ckpt, out, cli = work / f"{hf_dir.name}_ckpt", work / f"{hf_dir.name}_out", ["-m", "checkpoint_tools"]
    phases = {
        "hf-to-mcore": _run([*cli, "hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt), "--quiet"]),
        "mcore-to-hf": _run([*cli, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet",
                             "--max-shard-size", "500MB"]),
    }
    start = time.perf_counter()
    ranks = run_on_ranks(_direct_load_rank, 2, (str(hf_dir),), timeout_s=1800)
    wall = time.perf_counter() - start
    phases["direct load, tp=2 (per rank)"] = (wall, max(r[0] for r in ranks), max(r[1] for r in ranks))
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workdir", default="/tmp/convert_bench")
    opts = parser.parse_args()
    work = Path(opts.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    total, largest = generate(work / "hf", opts.layers, BIG)
    generate(work / "tiny", 1, TINY)
    print(f"model: {total / GB:.2f} GB fp32 ({opts.layers} layers), largest tensor "
          f"{largest / 1e6:.0f} MB")
    start = time.perf_counter()
    shutil.copytree(work / "hf", work / "copy")
    copy_s = time.perf_counter() - start
    shutil.rmtree(work / "copy")
    print(f"plain copy (page cache warm, as for the conversions): {copy_s:.2f} s = "
          f"{total / GB / copy_s:.2f} GB/s")
    user_s = _userspace_copy(work / "hf", work / "copy")
    shutil.rmtree(work / "copy")
    print(f"read + write through user space (the floor for a converter): {user_s:.2f} s = "
          f"{total / GB / user_s:.2f} GB/s ({copy_s / user_s:.2f}x plain copy)")
    baseline = _phases(work, work / "tiny")
    for name, (wall, seconds, rss) in _phases(work, work / "hf").items():
        above = rss - baseline[name][2]
        print(f"{name}: {seconds:.2f} s = {total / GB / seconds:.2f} GB/s "
              f"({copy_s / seconds:.2f}x plain copy, {user_s / seconds:.2f}x user-space copy; "
              f"wall with imports {wall:.1f} s); "
              f"peak RSS {rss:.0f} MB ({rss * 1e6 / largest:.1f}x largest tensor); "
              f"above the same phase on a 1 MB model: {above:.0f} MB = "
              f"{above * 1e6 / largest:.1f}x largest tensor, {above * 1e6 / total:.2f}x model")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
