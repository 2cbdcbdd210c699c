"""Refit: hand the actor's current weights to a rollout engine, bucket by bucket.

Protocol (every rank of the actor calls `refit_rollout`; the stage senders talk to the rollout):
  1. pause      the first stage's sender calls rollout.begin_weight_update()
  2. send       stage by stage (one bucket in flight at a time), each sender exports its layers
                (TP-gathered per tensor), packs a bucket, the rollout loads it
  3. resume     the first stage's sender calls rollout.finish_weight_update(version), which
                resets the prefix cache and reports the version back
The stages go one after another with a barrier between them, and each sender streams tensors
into one reusable bucket buffer, so the extra memory of the whole refit is about one bucket plus
one gathered tensor (measured in benchmarks/refit_bench.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rlhf_megatron.refit.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketLayout,
    BucketWriter,
    layer_bytes_of,
)
from rlhf_megatron.refit.export import is_stage_sender, iter_refit_tensors, refit_params


class PendingLoad(Protocol):
    def wait(self) -> None: ...


class RolloutClient(Protocol):
    """What refit needs from a rollout engine (a Ray actor handle, or a connection to one)."""

    def begin_weight_update(self) -> bool:
        """Pause; True when the engine needs the full weights (an adapter refit's base)."""
        ...

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
    full: bool = False
    """A rollout engine asked for the full weights (a LoRA adapter refit then sends the base
    too: rollout/vllm_lora.py AdapterSlot)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase on the sender: gather (TP all-gather), map (mapping table),
    transport (staging + moving the bucket), load (the rollout loading it)."""


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
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        # At EP > 1 the ranks of replica 0's EP group hold the other experts: they take part
        # in the export's EP gathers (refit/export.py); only replica 0 sends.
        in_replica_0 = parallel_state.get_expert_data_parallel_rank() == 0
    sender = is_stage_sender()
    first_stage = parallel_state.get_pipeline_model_parallel_rank() == 0
    full = False
    if sender and first_stage:
        full = bool(rollout.begin_weight_update())
    stats.full = full = _any_rank(full, engine)  # every stage's sender sends the same kind
    for stage in range(parallel_state.get_pipeline_model_parallel_world_size()):
        if in_replica_0 and parallel_state.get_pipeline_model_parallel_rank() == stage:
            _send_stage(engine, rollout if sender else None, transport, bucket_bytes, stats,
                        full=full)
        dist.barrier()
    if sender and first_stage:
        stats.version = rollout.finish_weight_update(version)
    stats.seconds = time.perf_counter() - start
    return stats


def _any_rank(flag: bool, engine: Any) -> bool:
    """`flag` of any rank, on every rank (a collective of all ranks, like the barrier it is)."""
    value = torch.tensor([int(flag)], device=engine.platform.device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _send_stage(
    engine: Any, rollout: RolloutClient | None, transport: Any, bucket_bytes: int,
    stats: RefitStats, *, full: bool,
) -> None:
    from megatron.core import parallel_state

    phases = stats.phases
    tensors = iter_refit_tensors(engine, full=full, timings=phases)
    if rollout is None:
        for _ in tensors:  # non-sender ranks only take part in the TP gathers
            pass
        return
    tp = parallel_state.get_tensor_model_parallel_world_size()
    named = refit_params(engine, full=full)
    layer_bytes = layer_bytes_of(named, tp, parallel_state.get_expert_model_parallel_world_size())
    largest_other = max(
        (p.numel() * p.element_size() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
         for n, p in named if not n.startswith("decoder.layers.")), default=0,
    )
    capacity = max(bucket_bytes, largest_other, *layer_bytes.values())
    start = time.perf_counter()
    buffer = transport.staging(capacity)
    phases["transport"] = phases.get("transport", 0.0) + time.perf_counter() - start

    in_flush = [0.0]  # flushes happen inside writer.add; keep their time out of "transport"

    def flush(layout: BucketLayout) -> None:
        start = time.perf_counter()
        handle = transport.send(layout)
        pending = rollout.load_bucket(handle)
        transport.push(handle)
        pushed = time.perf_counter()
        pending.wait()
        transport.release(handle)
        phases["transport"] = phases.get("transport", 0.0) + pushed - start
        done = time.perf_counter()
        phases["load"] = phases.get("load", 0.0) + done - pushed
        in_flush[0] += done - start
        stats.buckets += 1
        stats.tensors += len(layout.specs)
        stats.bytes_sent += layout.nbytes
        stats.max_bucket_bytes = max(stats.max_bucket_bytes, layout.nbytes)

    writer = BucketWriter(buffer, flush, layer_bytes, capacity)
    for item in tensors:
        start, flushed = time.perf_counter(), in_flush[0]
        writer.add(item)
        elapsed = time.perf_counter() - start - (in_flush[0] - flushed)
        phases["transport"] = phases.get("transport", 0.0) + elapsed
    writer.flush()
