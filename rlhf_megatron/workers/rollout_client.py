"""Refit's RolloutClient over Ray: one sender fans each bucket out to every rollout engine.

The bucket itself never passes through Ray: a handle names a shared-memory segment (CPU, same
node), a CUDA IPC handle (GPU, same node) or a broadcast group (another node); only those small
handles are sent, one per engine (FanoutHandle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRANSPORT_KINDS = ("auto", "local", "broadcast")


@dataclass(frozen=True)
class FanoutHandle:
    """The handle each rollout engine gets for one bucket (index = engine)."""

    per_engine: tuple[Any, ...]


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
        per_engine = handle.per_engine if isinstance(handle, FanoutHandle) \
            else (handle,) * len(self.handles)
        return _PendingLoads([h.load_bucket.remote(p)
                              for h, p in zip(self.handles, per_engine, strict=True)])

    def finish_weight_update(self, version: int) -> int:
        import ray

        versions = ray.get([h.finish_weight_update.remote(version) for h in self.handles])
        if len(set(versions)) != 1:
            raise RuntimeError(f"rollout engines report weight versions {versions} after a refit "
                               f"to version {version}")
        return versions[0]


def local_transport(engine: Any) -> Any:
    """Same node: CUDA IPC on GPU (the hybrid layout shares the devices), shared memory on CPU."""
    from rlhf_megatron.refit import CudaIpcTransport, SharedMemoryTransport

    if engine.platform.is_cuda:
        return CudaIpcTransport(engine.platform.device())
    return SharedMemoryTransport()


class FanoutTransport:
    """One staging buffer; engines on this node read it in place (one local transport shared by
    all of them), engines elsewhere get it by broadcast (one two-party group each)."""

    def __init__(self, engine: Any, engine_ips: list[str], my_ip: str, kind: str) -> None:
        from rlhf_megatron.refit import BroadcastTransport
        from rlhf_megatron.workers.megatron_worker import free_port

        if kind not in TRANSPORT_KINDS:
            raise ValueError(f"refit transport {kind!r}: expected one of {TRANSPORT_KINDS}")
        self.remote: dict[int, Any] = {}
        self.local_engines: list[int] = []
        for i, ip in enumerate(engine_ips):
            if kind == "local" or (kind == "auto" and ip == my_ip):
                self.local_engines.append(i)
            else:
                self.remote[i] = BroadcastTransport(my_ip, free_port(),
                                                    device=engine.platform.device())
        self.local = local_transport(engine) if self.local_engines else None
        self.engines = len(engine_ips)

    def staging(self, capacity: int) -> Any:
        first = self.local if self.local is not None else next(iter(self.remote.values()))
        buffer = first.staging(capacity)
        for transport in self.remote.values():
            transport._buffer = buffer  # every broadcast sends the one staged bucket
        return buffer

    def send(self, layout: Any) -> FanoutHandle:
        local = self.local.send(layout) if self.local is not None else None
        return FanoutHandle(tuple(self.remote[i].send(layout) if i in self.remote else local
                                  for i in range(self.engines)))

    def push(self, handle: FanoutHandle) -> None:
        if self.local is not None:
            self.local.push(handle.per_engine[self.local_engines[0]])
        for i, transport in self.remote.items():
            transport.push(handle.per_engine[i])

    def release(self, handle: FanoutHandle) -> None:
        if self.local is not None:
            self.local.release(handle.per_engine[self.local_engines[0]])

    def close(self) -> None:
        for transport in [self.local, *self.remote.values()]:
            if transport is not None:
                transport.close()
