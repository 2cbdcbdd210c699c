"""Device and collective backend, chosen once per process.

Every other module asks this one which device to put tensors on and which backend to use for
torch.distributed; none of them checks for CUDA on its own (shared/docs/DESIGN.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Platform:
    """What this process runs on.

    device_type: "cuda" or "cpu".
    backend: the torch.distributed backend that goes with it ("nccl" or "gloo").
    """

    device_type: str
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def device(self, local_rank: int | None = None) -> torch.device:
        """The torch.device of this rank (cuda:<local_rank> on GPU, cpu otherwise)."""
        if not self.is_cuda:
            return torch.device("cpu")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank)

    def release_cached_memory(self) -> None:
        """Hand memory that freed tensors left in the allocator's cache back to the device.

        On CUDA, PyTorch's caching allocator keeps freed blocks reserved for this process, so a
        colocated process (vLLM waking up) sees none of it until `torch.cuda.empty_cache()`.
        On CPU there is no such cache here (freed storages go back to malloc): a no-op.
        """
        if self.is_cuda:
            torch.cuda.empty_cache()

    def resident_bytes(self) -> int:
        """Memory this process holds on its device: allocated CUDA memory on GPU; on CPU the
        anonymous resident memory (`RssAnon`, where tensors live) once the heap's free blocks are
        handed back to the OS, so garbage freed earlier does not count. Offload metrics are
        differences of this. Not the whole RSS: its file-backed part (mapped libraries, hundreds
        of MB in a worker) moves with the page cache, which other processes' memory pressure
        evicts from, and a tiny model's state is ~1 MB (one CI run's onload rise of the whole
        RSS came out 0.18 MB short of the bytes moved back)."""
        if self.is_cuda:
            return int(torch.cuda.memory_allocated())
        return_free_heap_to_os()
        return _anonymous_resident_bytes()

    @property
    def supports_distributed_optimizer(self) -> bool:
        # Megatron's DistributedOptimizer rejects non-CUDA parameters (STACK.md, call site 5).
        return self.is_cuda

    @property
    def supports_context_parallel(self) -> bool:
        # "Context parallelism is only supported by TEDotProductAttention", and TE is GPU-only.
        return self.is_cuda and transformer_engine_available()


def _anonymous_resident_bytes() -> int:
    """`RssAnon` of /proc/self/status (Linux); the whole RSS where the kernel has no such line."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        pass
    import psutil

    return int(psutil.Process().memory_info().rss)


def return_free_heap_to_os() -> None:
    """glibc keeps freed small/medium blocks in its heap; malloc_trim hands them back so RSS
    really drops after a CPU offload. A no-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@functools.cache
def current_platform() -> Platform:
    """The platform of this process, detected once (a pure function of the machine, so cached).

    Set RLHF_MEGATRON_DEVICE=cpu to force the CPU path on a GPU machine.
    """
    forced = os.environ.get("RLHF_MEGATRON_DEVICE", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"RLHF_MEGATRON_DEVICE={forced!r}: expected 'cpu' or 'cuda'")
    use_cuda = torch.cuda.is_available() if forced == "" else forced == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("RLHF_MEGATRON_DEVICE=cuda but torch sees no CUDA device")
    return Platform("cuda", "nccl") if use_cuda else Platform("cpu", "gloo")


@functools.cache
def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (GPU clusters); never on the CPU stack."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a missing cuDNN shared object on CPU machines
        return False
    return True
