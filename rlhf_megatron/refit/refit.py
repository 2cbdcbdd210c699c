"""Refit: hand the actor's current weights to a rollout engine, bucket by bucket.

Protocol (every rank of the actor calls `refit_rollout`; the stage senders talk to the rollout):
  1. pause      the first stage's sender calls rollout.begin_weight_update()
  2. send       stage by stage (one bucket in flight at a time), each sender exports its layers
                (TP-gathered per tensor), packs a bucket, the rollout loads it
  3. resume     the first stage's sender calls rollout.finish_weight_update(version), which
                resets the prefix cache and reports the version back
The stages go one after another with a barrier between them, so the extra memory of the whole
refit is about one bucket (measured in benchmarks/refit_bench.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from rlhf_megatron.refit.buckets import DEFAULT_BUCKET_BYTES, iter_buckets, layout_of
from rlhf_megatron.refit.export import is_stage_sender, iter_hf_tensors


class PendingLoad(Protocol):
    def wait(self) -> None: ...


class RolloutClient(Protocol):
    """What refit needs from a rollout engine (a Ray actor handle, or a connection to one)."""

    def begin_weight_update(self) -> None: ...

    def load_bucket(self, handle: Any) -> PendingLoad: ...

    def finish_weight_update(self, version: int) -> int: ...


@dataclass
class RefitStats:
    buckets: int = 0
    tensors: int = 0
    bytes_sent: int = 0
    max_bucket_bytes: int = 0
    seconds: float = 0.0
    version: int | None = None


def refit_rollout(
    engine: Any, rollout: RolloutClient | None, transport: Any, *, version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> RefitStats:
    """Send `engine`'s weights to `rollout` through `transport`; call on every engine rank.

    `rollout` and `transport` are used on the stage senders only (others may pass None).
    Returns this rank's stats; `version` is set on the first stage's sender.
    """
    from megatron.core import parallel_state

    stats = RefitStats()
    start = time.perf_counter()
    in_replica_0 = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    sender = is_stage_sender()
    first_stage = parallel_state.get_pipeline_model_parallel_rank() == 0
    if sender and first_stage:
        rollout.begin_weight_update()
    dist.barrier()
    for stage in range(parallel_state.get_pipeline_model_parallel_world_size()):
        if in_replica_0 and parallel_state.get_pipeline_model_parallel_rank() == stage:
            _send_stage(engine, rollout if sender else None, transport, bucket_bytes, stats)
        dist.barrier()
    if sender and first_stage:
        stats.version = rollout.finish_weight_update(version)
    stats.seconds = time.perf_counter() - start
    return stats


def _send_stage(
    engine: Any, rollout: RolloutClient | None, transport: Any, bucket_bytes: int,
    stats: RefitStats,
) -> None:
    for index, bucket in enumerate(iter_buckets(iter_hf_tensors(engine), bucket_bytes)):
        if rollout is None:
            continue  # non-sender ranks only take part in the TP gathers
        layout = layout_of(index, bucket)
        handle = transport.send(layout, bucket)
        pending = rollout.load_bucket(handle)
        transport.push(handle)
        pending.wait()
        transport.release(handle)
        stats.buckets += 1
        stats.tensors += len(bucket)
        stats.bytes_sent += layout.nbytes
        stats.max_bucket_bytes = max(stats.max_bucket_bytes, layout.nbytes)
