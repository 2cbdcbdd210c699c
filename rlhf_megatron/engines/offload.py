"""Offload an engine's parameters, gradient buffers and optimizer state, and bring them back.

Colocated ("hybrid") training frees the accelerator for rollout between updates. Each unique
storage is copied out byte for byte and then resized to 0 bytes, so every tensor and view over it
(params, DDP `main_grad` views, optimizer state) stays the same Python object; onload resizes the
storage back and copies the bytes in, which restores it bitwise.

Where the bytes go: on GPU, pinned host memory. On CPU there is no "host" below the device, so
they go to a spill file (a temp dir, or `spill_dir`), read back on onload; the resident memory
(RSS) of the process drops by what the allocator returns to the OS.

Giving the memory back: resizing a CUDA storage to 0 bytes returns its block to PyTorch's caching
allocator, which keeps it reserved for this process. `offload()` then asks the platform to release
cached memory (`Platform.release_cached_memory`: `torch.cuda.empty_cache()` on CUDA, a no-op on
CPU), so the device's free memory (`torch.cuda.mem_get_info`) rises by about the bytes offloaded
and a colocated vLLM can use it. `offloaded_bytes` says how many bytes the last offload moved.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.engines.optimizer_state import megatron_optimizers
from rlhf_megatron.platform import Platform, current_platform, return_free_heap_to_os

_STAGING_BYTES = 16 << 20


@dataclass
class _Stored:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None  # pinned copy (GPU)
    offset: int = 0  # position in the spill file (CPU)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def engine_state_tensors(engine: Any) -> list[torch.Tensor]:
    """Parameters, DDP grad buffers and optimizer state (incl. fp32 main params) of an engine."""
    tensors: list[torch.Tensor] = []
    for chunk in engine.chunks:
        tensors += list(chunk.parameters())
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            tensors.append(buffer.grad_data)
            if getattr(buffer, "param_data", None) is not None:
                tensors.append(buffer.param_data)
    for optimizer in (m.optimizer for m in megatron_optimizers(engine.optimizer)):
        for group in optimizer.param_groups:
            tensors += list(group["params"])  # fp32 main params of mixed-precision optimizers
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors




class Offloader:
    """`offload(tensors)` then `onload()`; one offload at a time.

    platform: whose `release_cached_memory()` runs after the storages are freed (default: this
        process's platform).
    """

    def __init__(
        self, spill_dir: str | Path | None = None, platform: Platform | None = None
    ) -> None:
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.platform = platform or current_platform()
        self.offloaded_bytes = 0  # bytes moved out by the offload in progress (0 when onloaded)
        self._stored: list[_Stored] = []
        self._spill_path: Path | None = None
        # File I/O goes through one staging buffer: exposing a storage to numpy/memoryview
        # would make it non-resizable, and offload relies on resizing storages to 0 bytes.
        self._staging = torch.empty(_STAGING_BYTES, dtype=torch.uint8)
        self._staging_view = memoryview(self._staging.numpy())

    @property
    def offloaded(self) -> bool:
        return bool(self._stored)

    def offload(self, tensors: list[torch.Tensor]) -> int:
        """Move the storages of `tensors` out; returns the bytes freed."""
        if self._stored:
            raise RuntimeError("offload() called twice without onload()")
        seen: set[int] = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            self._stored.append(_Stored(storage, storage.nbytes()))
        if self._stored and self._stored[0].storage.device.type == "cuda":
            self._offload_to_pinned_host()
        else:
            self._offload_to_spill_file()
        for item in self._stored:
            item.storage.resize_(0)
        if self._spill_path is not None:
            return_free_heap_to_os()
        # The freed blocks sit in the allocator's cache until released (module docstring).
        self.platform.release_cached_memory()
        self.offloaded_bytes = sum(item.nbytes for item in self._stored)
        return self.offloaded_bytes

    def onload(self) -> None:
        """Restore every storage bitwise."""
        if not self._stored:
            return
        spill = open(self._spill_path, "rb") if self._spill_path else None  # noqa: SIM115
        try:
            for item in self._stored:
                item.storage.resize_(item.nbytes)
                target = _bytes_of(item.storage)
                if item.host is not None:
                    target.copy_(item.host, non_blocking=True)
                else:
                    spill.seek(item.offset)
                    self._read_into(spill, target)
            if self._stored[0].storage.device.type == "cuda":
                torch.cuda.synchronize()
        finally:
            if spill is not None:
                spill.close()
                os.unlink(self._spill_path)
            self._spill_path = None
            self._stored = []
            self.offloaded_bytes = 0

    def _offload_to_pinned_host(self) -> None:
        for item in self._stored:
            item.host = torch.empty(item.nbytes, dtype=torch.uint8, pin_memory=True)
            item.host.copy_(_bytes_of(item.storage), non_blocking=True)
        torch.cuda.synchronize()

    def _offload_to_spill_file(self) -> None:
        handle, path = tempfile.mkstemp(prefix="rlhf_megatron_offload_", dir=self.spill_dir)
        self._spill_path = Path(path)
        with os.fdopen(handle, "wb") as spill:
            for item in self._stored:
                item.offset = spill.tell()
                source = _bytes_of(item.storage)
                for start in range(0, item.nbytes, _STAGING_BYTES):
                    piece = source[start : start + _STAGING_BYTES]
                    self._staging[: len(piece)].copy_(piece)
                    spill.write(self._staging_view[: len(piece)])

    def _read_into(self, spill: Any, target: torch.Tensor) -> None:
        for start in range(0, target.numel(), _STAGING_BYTES):
            piece = target[start : start + _STAGING_BYTES]
            spill.readinto(self._staging_view[: len(piece)])
            piece.copy_(self._staging[: len(piece)])
