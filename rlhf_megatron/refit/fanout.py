"""Refit over Ray: the actor's side of its connection to the rollout engines.

`connect_rollout` is called once on every actor rank when the worker groups are built; it
chooses the topology (which engines share the sender's node) and keeps the connection, so each
step's refit is `RolloutLink.refit(version)`.

RayRolloutFanout is refit.RolloutClient over the rollout workers' Ray handles: one sender fans each
bucket out to every engine. The bucket itself never passes through Ray: a handle names a
shared-memory segment (CPU, same node), a CUDA IPC handle (GPU, same node) or a broadcast group
(another node); only those small handles are sent, one per engine (FanoutHandle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_megatron.errors import WorkerFailure
from rlhf_megatron.platform.net import free_port, node_ip
from rlhf_megatron.refit.export import is_stage_sender
from rlhf_megatron.refit.refit import RefitStats, refit_rollout
from rlhf_megatron.refit.transports import (
    BroadcastTransport,
    CudaIpcTransport,
    SharedMemoryTransport,
)

TRANSPORT_KINDS = ("auto", "local", "broadcast")


@dataclass(frozen=True)
class FanoutHandle:
    """The handle each rollout engine gets for one bucket (index = engine)."""

    per_engine: tuple[Any, ...]


def _engine_died(exc: BaseException) -> bool:
    """A rollout engine's call failed because the engine is gone: its Ray actor died, or its
    vLLM process did (the worker raises WorkerFailure). Anything else is a bug and propagates."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayActorError):
        return True
    return isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None),
                                                        WorkerFailure)


class _PendingLoads:
    def __init__(self, fanout: RayRolloutFanout, refs: dict[int, Any]) -> None:
        self._fanout, self._refs = fanout, refs

    def wait(self) -> None:
        self._fanout._get(self._refs)


class RayRolloutFanout:
    """Implements refit.RolloutClient over the Ray handles of the rollout workers.

    An engine that dies during a refit is left out of the rest of it (`lost`), so the refit
    completes on the others and every actor rank runs the same collectives; the controller
    finds the death on its next call to that engine (controller/async_rollout.py replaces it).
    Only when every engine is gone does the refit fail."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)
        self.lost: set[int] = set()
        """Engines that died (a replacement is a new handle, connected anew)."""
        self._first_loss = ""

    def _get(self, refs: dict[int, Any]) -> dict[int, Any]:
        import ray

        results = {}
        for i, ref in refs.items():
            try:
                results[i] = ray.get(ref)
            except Exception as exc:
                if not _engine_died(exc):
                    raise
                self.lost.add(i)
                self._first_loss = self._first_loss or str(exc)
        if len(self.lost) == len(self.handles):
            first = (self._first_loss.strip().splitlines() or [""])[-1][:300]
            raise WorkerFailure(f"every rollout engine died during the refit: {first}")
        return results

    def _live(self) -> list[int]:
        return [i for i in range(len(self.handles)) if i not in self.lost]

    def begin_weight_update(self) -> bool:
        """Pause every engine; True when any of them needs the full weights (an adapter refit
        then sends the base as well, to all of them)."""
        return any(self._get({i: self.handles[i].begin_weight_update.remote()
                              for i in self._live()}).values())

    def load_bucket(self, handle: Any) -> _PendingLoads:
        per_engine = handle.per_engine if isinstance(handle, FanoutHandle) \
            else (handle,) * len(self.handles)
        return _PendingLoads(self, {i: self.handles[i].load_bucket.remote(per_engine[i])
                                    for i in self._live()})

    def finish_weight_update(self, version: int) -> int:
        versions = list(self._get({i: self.handles[i].finish_weight_update.remote(version)
                                   for i in self._live()}).values())
        if len(set(versions)) != 1:
            raise RuntimeError(f"rollout engines report weight versions {versions} after a refit "
                               f"to version {version}")
        return versions[0]


def local_transport(engine: Any) -> Any:
    """Same node: CUDA IPC on GPU (the hybrid layout shares the devices), shared memory on CPU."""
    if engine.platform.is_cuda:
        return CudaIpcTransport(engine.platform.device())
    return SharedMemoryTransport()


class FanoutTransport:
    """One staging buffer; engines on this node read it in place (one local transport shared by
    all of them), engines elsewhere get it by broadcast (one two-party group each)."""

    def __init__(self, engine: Any, engine_ips: list[str], my_ip: str, kind: str) -> None:
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


class RolloutLink:
    """One actor rank's connection to the rollout engines (see connect_rollout). On ranks that
    are not a stage sender `client` and `transport` are None: those ranks only take part in the
    TP gathers of a refit."""

    def __init__(self, engine: Any, client: RayRolloutFanout | None,
                 transport: FanoutTransport | None, bucket_bytes: int) -> None:
        self.engine, self.client, self.transport = engine, client, transport
        self.bucket_bytes = bucket_bytes

    def refit(self, version: int) -> RefitStats:
        """Send the engine's current weights to every rollout engine as `version`; every rank
        of the actor calls this together."""
        return refit_rollout(self.engine, self.client, self.transport, version=version,
                             bucket_bytes=self.bucket_bytes)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def connect_rollout(engine: Any, rollout_handles: list[Any], bucket_bytes: int,
                    transport_kind: str = "auto") -> RolloutLink:
    """Connect this actor rank to the rollout workers (Ray handles with begin_weight_update /
    load_bucket / finish_weight_update / node_ip) once; call after the engine is built. Stage
    senders pick each engine's transport by `transport_kind` (TRANSPORT_KINDS)."""
    import ray

    if not is_stage_sender():
        return RolloutLink(engine, None, None, bucket_bytes)
    engine_ips = ray.get([h.node_ip.remote() for h in rollout_handles])
    transport = FanoutTransport(engine, engine_ips, node_ip(), transport_kind)
    return RolloutLink(engine, RayRolloutFanout(rollout_handles), transport, bucket_bytes)
