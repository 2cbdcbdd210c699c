"""Shared pieces of the converter: atomic output directories, the converted checkpoint's metadata
file, HF asset copying and an in-process single-rank process group."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from rlhf_megatron.errors import CheckpointError, ConfigError

# The checkpoint metadata lives in the library (rlhf_megatron.models.checkpoint_meta) so the
# engines do not import this CLI package; it is re-exported here for the converter.
from rlhf_megatron.models.checkpoint_meta import (  # noqa: F401
    _OPTIMIZER_KEY,
    _WEIGHT_SUFFIXES,
    ASSETS_DIR,
    DTYPES,
    FORMAT_VERSION,
    METADATA_FILE,
    ConvertedMetadata,
    copy_hf_assets,
    dtype_name,
    hf_assets_dir,
    is_megatron_checkpoint,
    is_model_key,
)


def check_output_dir(out: Path, *, force: bool) -> None:
    """Refuse an existing non-empty output unless `force` (it is then replaced at the end)."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CheckpointError(f"output {out} exists and is not empty; pass --force to replace it")


@contextlib.contextmanager
def atomic_output_dir(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield a temp dir next to `out`; rename it to `out` on success, delete it on any failure."""
    check_output_dir(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


@contextlib.contextmanager
def process_group_of_one() -> Iterator[None]:
    """A world-size-1 gloo default process group in this process (kept if one exists)."""
    import torch.distributed as dist

    from rlhf_megatron.parallel import initialize_distributed
    from rlhf_megatron.testing.multirank import find_free_port

    created = not dist.is_initialized()
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()),
                          RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        initialize_distributed()
    try:
        yield
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """`process_group_of_one` plus a TP=PP=1 Megatron layout, torn down after."""
    from rlhf_megatron.parallel import ParallelDims, parallel_layout

    with process_group_of_one(), parallel_layout(ParallelDims(1), seed=1234):
        yield


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB.

    Linux's VmHWM is per address space; `ru_maxrss` would also count a parent's peak from before
    this process's exec, which misleads in subprocesses spawned by a big parent.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '300KB' / '1024' -> bytes (decimal units, as transformers uses)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    unit = next((u for u in sorted(units, key=len, reverse=True) if upper.endswith(u)), "")
    number, factor = upper[: len(upper) - len(unit)].strip(), units.get(unit, 1)
    try:
        size = int(float(number) * factor)
    except ValueError:
        raise ConfigError(f"--max-shard-size={text!r} is not a size like 5GB or 500MB") from None
    if size <= 0:
        raise ConfigError(f"--max-shard-size={text!r} must be positive")
    return size
