"""Refit: actor shards -> mapping table -> layer-aligned buckets -> transport -> rollout weights.

fanout.py connects an actor rank to the rollout engines once (topology, transports) and runs each
refit over that connection (RolloutLink.refit(version))."""

from rlhf_megatron.refit.buckets import DEFAULT_BUCKET_BYTES, BucketLayout, BucketWriter
from rlhf_megatron.refit.export import ExportedTensor, is_stage_sender, iter_hf_tensors
from rlhf_megatron.refit.fanout import (
    TRANSPORT_KINDS,
    FanoutTransport,
    RayRolloutFanout,
    RolloutLink,
    connect_rollout,
    local_transport,
)
from rlhf_megatron.refit.refit import RefitStats, RolloutClient, refit_rollout
from rlhf_megatron.refit.transports import (
    BroadcastReceiver,
    BroadcastTransport,
    CudaIpcTransport,
    SharedMemoryTransport,
    receive,
)

__all__ = [
    "TRANSPORT_KINDS",
    "FanoutTransport",
    "RayRolloutFanout",
    "RolloutLink",
    "connect_rollout",
    "local_transport",
    "DEFAULT_BUCKET_BYTES",
    "BroadcastReceiver",
    "BroadcastTransport",
    "BucketLayout",
    "BucketWriter",
    "CudaIpcTransport",
    "ExportedTensor",
    "RefitStats",
    "RolloutClient",
    "SharedMemoryTransport",
    "is_stage_sender",
    "iter_hf_tensors",
    "receive",
    "refit_rollout",
]
