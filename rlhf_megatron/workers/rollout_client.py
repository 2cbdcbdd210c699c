"""Refit's RolloutClient over Ray: one sender fans each bucket out to every rollout engine.

The bucket itself never passes through Ray: the handle names a shared-memory segment (CPU), a CUDA
IPC handle (same node, GPU) or a broadcast group; only that small handle is sent to each engine.
"""

from __future__ import annotations

from typing import Any


class _PendingLoads:
    def __init__(self, refs: list[Any]) -> None:
        self._refs = refs

    def wait(self) -> None:
        import ray

        ray.get(self._refs)


class RayRolloutFanout:
    """Implements refit.RolloutClient over the Ray handles of the rollout workers."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)

    def begin_weight_update(self) -> None:
        import ray

        ray.get([h.begin_weight_update.remote() for h in self.handles])

    def load_bucket(self, handle: Any) -> _PendingLoads:
        return _PendingLoads([h.load_bucket.remote(handle) for h in self.handles])

    def finish_weight_update(self, version: int) -> int:
        import ray

        versions = ray.get([h.finish_weight_update.remote(version) for h in self.handles])
        return versions[0]


def transport_for(engine: Any) -> Any:
    """The refit transport of this platform: CUDA IPC on GPU (rollout engines share the node and
    the devices in the hybrid layout), shared memory on CPU."""
    from rlhf_megatron.refit import CudaIpcTransport, SharedMemoryTransport

    if engine.platform.is_cuda:
        return CudaIpcTransport(engine.platform.device())
    return SharedMemoryTransport()
