"""Converter benchmark: a generated fp32 Llama-shaped checkpoint (random init; ~0.9 GB with the
default 2 layers), both ways, against `shutil.copytree` of the same checkpoint.

    .venv/bin/python benchmarks/convert_bench.py [--layers 2] [--repeat 3] [--direct-load]
        [--workdir /tmp/convert_bench]

Prints, for hf-to-mcore and mcore-to-hf (dtype kept: the in-kernel copy path): time after imports
(each run in its own process), GB/s, the ratio to `shutil.copytree` of that direction's source
directory (in-kernel, page cache warm as for the conversions; timed in pairs with the conversion,
each after `sync`, the median pair shown) and to a read + write of the same files through user
space, the phase breakdown (in-kernel copies vs everything
else: process group, plan, metadata, assets), peak RSS and peak RSS over the largest single tensor
(raw, and above the same phase run on a 1 MB model, i.e. without the constant cost of imports and
runtime). `--direct-load` adds the load of the HF files into TP=2 shards (2 ranks).
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


def _run(args: list[str]) -> tuple[float, float, float, float, float]:
    """(wall seconds, conversion seconds, seconds of in-kernel copies, peak RSS MB, seconds of
    process group set-up and teardown) of the child, as printed by the CLI."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                            text=True)
    seconds = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{args} failed:\n{result.stderr[-3000:]}")
    rss = re.search(r"peak RSS (\d+) MB", result.stdout)
    inner = re.search(r"in ([\d.]+) s", result.stdout)
    copies = re.search(r"copied in the kernel in ([\d.]+) s", result.stdout)
    group = re.search(r"process group set up and torn down in ([\d.]+) s", result.stdout)
    return (seconds, float(inner.group(1)) if inner else seconds,
            float(copies.group(1)) if copies else 0.0, float(rss.group(1)),
            float(group.group(1)) if group else 0.0)


def _paired(args: list[str], out: Path, source: Path, repeat: int) -> tuple[tuple, float]:
    """`repeat` pairs of (`shutil.copytree` of `source`, the conversion `args`), each timed
    right after `sync` with its output removed, so both meet the same page-cache and writeback
    state (on this VM, dirty pages left by earlier runs slow whichever runs next). Returns the
    conversion run and the copytree seconds of the pair with the median ratio."""
    pairs = []
    for _ in range(repeat):
        copy_s = _copytree_seconds(source, out.parent / "copy")
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        run = _run(args)
        pairs.append((copy_s / run[1], run, copy_s))
    pairs.sort(key=lambda pair: pair[0])
    _, run, copy_s = pairs[len(pairs) // 2]
    return run, copy_s


def _copytree_seconds(src: Path, dst: Path) -> float:
    """Time of `shutil.copytree(src, dst)` (in-kernel: sendfile), after `sync`."""
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    start = time.perf_counter()
    shutil.copytree(src, dst)
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


def _userspace_copy(src: Path, dst: Path) -> float:
    """Seconds to read each file into a fresh buffer and write it out (one user-space copy each
    way, as any converter that looks at the bytes must): the floor for the conversions."""
    dst.mkdir()
    start = time.perf_counter()
    for path in sorted(p for p in src.iterdir() if p.is_file()):
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


def _phases(work: Path, hf_dir: Path, repeat: int,
            direct_load: bool) -> dict[str, tuple[tuple, float]]:
    """name -> ((wall s, conversion s, in-kernel copy s, peak RSS MB, process group s), the
    paired copytree s) for each phase on `hf_dir`."""
    ckpt, out, cli = work / f"{hf_dir.name}_ckpt", work / f"{hf_dir.name}_out", ["-m", "checkpoint_tools"]
    phases = {
        "hf-to-mcore": _paired([*cli, "hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt),
                                "--quiet"], ckpt, hf_dir, repeat),
    }
    phases["mcore-to-hf"] = _paired([*cli, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out),
                                     "--quiet", "--max-shard-size", "500MB"], out, ckpt, repeat)
    if direct_load:
        from rlhf_megatron.testing.multirank import run_on_ranks

        start = time.perf_counter()
        ranks = run_on_ranks(_direct_load_rank, 2, (str(hf_dir),), timeout_s=1800)
        wall = time.perf_counter() - start
        phases["direct load, tp=2 (per rank)"] = ((wall, max(r[0] for r in ranks), 0.0,
                                                  max(r[1] for r in ranks), 0.0), 0.0)
    return phases


def _report(name: str, phase: tuple[float, float, float, float, float], total: int,
            largest: int, copy_s: float, user_s: float, baseline_rss: float) -> None:
    wall, seconds, copies, rss, group = phase
    above = rss - baseline_rss
    print(f"{name}: {seconds:.3f} s = {total / GB / seconds:.2f} GB/s; "
          f"{copy_s / seconds:.2f}x shutil.copytree of its source ({copy_s:.3f} s), "
          f"{user_s / seconds:.2f}x a user-space read + write; wall with imports {wall:.1f} s")
    if copies:
        print(f"    phases: in-kernel copies {copies:.3f} s ({total / GB / copies:.2f} GB/s, "
              f"{copy_s / copies:.2f}x copytree); process group + Megatron layout set-up and "
              f"teardown {group:.3f} s; the rest {seconds - copies - group:.3f} s (meta model, "
              f"plan, torch_dist / safetensors headers and metadata, assets); without the "
              f"process group {copy_s / (seconds - group):.2f}x copytree")
    print(f"    peak RSS {rss:.0f} MB ({rss * 1e6 / largest:.1f}x largest tensor); above the same "
          f"phase on a 1 MB model: {above:.0f} MB = {above * 1e6 / largest:.2f}x largest tensor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3,
                        help="(copytree, conversion) pairs per direction; the median counts")
    parser.add_argument("--direct-load", action="store_true", help="also load into TP=2 shards")
    parser.add_argument("--workdir", default="/tmp/convert_bench")
    parser.add_argument("--smoke", action="store_true", help="a 1 MB model: checks the script")
    opts = parser.parse_args()
    work = Path(opts.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    total, largest = generate(work / "hf", opts.layers, TINY if opts.smoke else BIG)
    generate(work / "tiny", 1, TINY)
    print(f"model: {total / GB:.2f} GB fp32 ({opts.layers} layers), largest tensor "
          f"{largest / 1e6:.0f} MB; {opts.repeat} (copytree, conversion) pairs per direction, "
          "each after sync; the pair with the median ratio is shown")
    user_hf = _userspace_copy(work / "hf", work / "copy")
    shutil.rmtree(work / "copy")
    baseline = _phases(work, work / "tiny", 1, opts.direct_load)
    phases = _phases(work, work / "hf", opts.repeat, opts.direct_load)
    user_ckpt = _userspace_copy(work / "hf_ckpt", work / "copy")
    shutil.rmtree(work / "copy")
    print(f"read + write through user space: HF dir {user_hf:.3f} s, Megatron checkpoint "
          f"{user_ckpt:.3f} s")
    users = {"hf-to-mcore": user_hf, "mcore-to-hf": user_ckpt}
    for name, (phase, copy_s) in phases.items():
        _report(name, phase, total, largest, copy_s, users.get(name, user_hf),
                baseline[name][0][3])
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
