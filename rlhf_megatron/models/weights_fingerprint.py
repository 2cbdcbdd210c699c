"""A fingerprint of a model directory's weights, for an adapter-only LoRA checkpoint to name the
base it was trained on (engines/checkpoint.py) and for a resume or an export to refuse another.

It hashes, for every weight file (safetensors, a dist-checkpoint's .distcp and .metadata): the
relative name, the size, the first 64 KiB (a safetensors header with every tensor's name, dtype,
shape and offsets; a distcp's first tensors) and 16 blocks of 4 KiB spread evenly over the rest,
the last one ending at the end of the file.
That is a few hundred kilobytes read per file, where a full hash of a 70B bf16 base (140 GB) costs
minutes at each save. It tells apart two fine-tunes of one architecture (their bytes differ
everywhere), not two files that differ in a few bytes between the sampled blocks.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rlhf_megatron.errors import CheckpointError

WEIGHT_SUFFIXES = (".safetensors", ".distcp", ".metadata", ".bin", ".pt")
HEAD_BYTES = 64 * 1024
BLOCKS = 16
BLOCK_BYTES = 4096


def weight_files(directory: Path) -> list[Path]:
    """The weight files under `directory`, sorted by relative path (a trainer checkpoint's
    rng/ and engine_state.pt are not weights and are left out)."""
    return sorted(path for path in directory.rglob("*")
                  if path.is_file() and path.suffix in WEIGHT_SUFFIXES
                  and path.name != "engine_state.pt" and "rng" not in path.relative_to(directory).parts)


def fingerprint(directory: str | Path) -> str:
    """`sha256:<hex>` of the sampled weights of `directory` (see the module docstring)."""
    directory = Path(directory)
    digest = hashlib.sha256()
    for path in weight_files(directory):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(directory)}\0{size}\0".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(HEAD_BYTES))
            span = size - HEAD_BYTES - BLOCK_BYTES  # the blocks start in [head, size - block]
            for i in range(BLOCKS if span > 0 else 0):
                handle.seek(HEAD_BYTES + span * i // (BLOCKS - 1))
                digest.update(handle.read(BLOCK_BYTES))
            if 0 < size - HEAD_BYTES <= BLOCK_BYTES:
                digest.update(handle.read())
    return f"sha256:{digest.hexdigest()}"


def check_base(ckpt_dir: Path, recorded: dict[str, str], base_dir: Path) -> None:
    """Refuse an adapter-only checkpoint (`recorded`: its metadata's base) on a base other than
    the one it was trained on."""
    if not base_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} holds LoRA adapters trained on the base "
                              f"{recorded['path']}, and {base_dir} does not exist")
    found = fingerprint(base_dir)
    if found != recorded["fingerprint"]:
        raise CheckpointError(
            f"{ckpt_dir} holds LoRA adapters trained on the base {recorded['path']} "
            f"({recorded['fingerprint'][:19]}), but this run's base {base_dir} is another "
            f"({found[:19]})")
