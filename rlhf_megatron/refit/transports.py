"""Weight transports: one class per way of moving a bucket, all behind the same methods.

Trainer side (the stage sender):
    buffer = transport.staging(capacity)      once: the bucket buffer tensors are written into
    per bucket, after writing its tensors into `buffer`:
    handle = transport.send(layout)           describe the staged bucket
    pending = rollout.load_bucket(handle)     ask the rollout to load it (not awaited yet)
    transport.push(handle)                    bytes that must move while the rollout waits
    pending.wait(); transport.release(handle)
Rollout side:  named_tensors = receive(handle), or BroadcastReceiver.receive(handle)

A handle is small and picklable (names, shapes, offsets, and a segment name / IPC handle /
group address); tensor bytes never go through pickle.

- SharedMemoryTransport: POSIX shared memory (a /dev/shm file mapped by both processes). The
  trainer writes the bucket once; vLLM reads the tensors in place from the mapping.
- CudaIpcTransport: the bucket is one CUDA buffer shared through a CUDA IPC handle with another
  process on the same GPU (hybrid/colocated layout); vLLM reads it in place.
- BroadcastTransport: torch.distributed broadcast (gloo on CPU, NCCL on GPU) over a two-party
  group between the sender and a rollout process on another node.
"""

from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.refit.buckets import BucketLayout, views_of

_SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class SharedMemoryHandle:
    path: str
    layout: BucketLayout


class SharedMemoryTransport:
    """One reusable shared-memory segment per sender, grown to the largest bucket."""

    kind = "shared_memory"

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory else _SHM_DIR
        self.path = self.directory / f"rlhf_megatron_refit_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._buffer: torch.Tensor | None = None
        self.peak_bytes = 0

    def staging(self, capacity: int) -> torch.Tensor:
        """The shared segment itself: tensors written here are what the rollout reads."""
        if self._buffer is None or self._buffer.numel() < capacity:
            self._map(capacity)
        return self._buffer

    def send(self, layout: BucketLayout) -> SharedMemoryHandle:
        self.peak_bytes = max(self.peak_bytes, layout.nbytes)
        return SharedMemoryHandle(str(self.path), layout)

    def push(self, handle: SharedMemoryHandle) -> None:
        """Nothing to push: the rollout maps the segment and reads in place."""

    def release(self, handle: SharedMemoryHandle) -> None:
        """The rollout has loaded the bucket; the segment is reused for the next one."""

    def close(self) -> None:
        self._buffer = None
        if self.path.exists():
            self.path.unlink()

    def _map(self, nbytes: int) -> None:
        self._buffer = None
        with open(self.path, "wb") as segment:
            segment.truncate(nbytes)
        self._buffer = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)


@dataclass(frozen=True)
class CudaIpcHandle:
    ipc: Any  # torch.multiprocessing's rebuild function and arguments for the CUDA buffer
    layout: BucketLayout


class CudaIpcTransport:
    """A CUDA bucket shared with another process on the same GPU through an IPC handle."""

    kind = "cuda_ipc"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None
        self.peak_bytes = 0

    def staging(self, capacity: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < capacity:
            self._buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        return self._buffer

    def send(self, layout: BucketLayout) -> CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(self.device).synchronize()  # bytes complete before sharing
        self.peak_bytes = max(self.peak_bytes, layout.nbytes)
        return CudaIpcHandle(reduce_tensor(self._buffer), layout)

    def push(self, handle: CudaIpcHandle) -> None:
        """Nothing to push: the rollout opens the IPC handle and reads in place."""

    def release(self, handle: CudaIpcHandle) -> None:
        """The receiver dropped its views; the buffer is reused for the next bucket."""

    def close(self) -> None:
        self._buffer = None
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class BroadcastHandle:
    address: tuple[str, int]
    layout: BucketLayout


class BroadcastTransport:
    """torch.distributed broadcast of each bucket from the sender (rank 0 of a private
    two-party group) to a rollout process (rank 1), e.g. on another node."""

    kind = "broadcast"

    def __init__(self, host: str, port: int, *, device: torch.device | None = None) -> None:
        self.address = (host, port)
        self.device = device or torch.device("cpu")
        self._group: Any = None
        self._buffer: torch.Tensor | None = None
        self.peak_bytes = 0

    def staging(self, capacity: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < capacity:
            self._buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        return self._buffer

    def send(self, layout: BucketLayout) -> BroadcastHandle:
        self.peak_bytes = max(self.peak_bytes, layout.nbytes)
        return BroadcastHandle(self.address, layout)

    def push(self, handle: BroadcastHandle) -> None:
        """Broadcast the staged bytes; the rollout's `receive` waits in the same collective."""
        if self._group is None:
            # Joined on the first push: by then the rollout has the load request and is
            # building its side of the group (BroadcastReceiver) at the same time.
            self._group = two_party_group(self.address, rank=0, device=self.device)
        self._group.broadcast(self._buffer[: handle.layout.nbytes], 0).wait()

    def release(self, handle: BroadcastHandle) -> None:
        """Nothing is kept between buckets."""

    def close(self) -> None:
        self._group = None
        self._buffer = None


def two_party_group(address: tuple[str, int], *, rank: int, device: torch.device) -> Any:
    """A process group of exactly {sender: 0, rollout: 1}, outside the default world."""
    import torch.distributed as dist

    store = dist.TCPStore(address[0], address[1], world_size=2, is_master=rank == 0,
                          timeout=datetime.timedelta(minutes=5))
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2)


class BroadcastReceiver:
    """The rollout side of BroadcastTransport."""

    def __init__(self, address: tuple[str, int], device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._group = two_party_group(tuple(address), rank=1, device=self.device)

    def receive(self, handle: BroadcastHandle) -> list[tuple[str, torch.Tensor]]:
        buffer = torch.empty(handle.layout.nbytes, dtype=torch.uint8, device=self.device)
        self._group.broadcast(buffer, 0).wait()
        return views_of(buffer, handle.layout)


def receive(handle: Any) -> list[tuple[str, torch.Tensor]]:
    """Rollout side of the shared-memory and CUDA IPC transports: tensors viewing the bytes."""
    if isinstance(handle, SharedMemoryHandle):
        buffer = torch.from_file(handle.path, shared=True, size=handle.layout.nbytes,
                                 dtype=torch.uint8)
        return views_of(buffer, handle.layout)
    if isinstance(handle, CudaIpcHandle):
        rebuild, args = handle.ipc
        return views_of(rebuild(*args), handle.layout)
    raise TypeError(f"no in-place receive for {type(handle).__name__}")
