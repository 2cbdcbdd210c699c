"""Refit: actor shards -> mapping table -> layer-aligned buckets -> transport -> rollout weights."""

from rlhf_megatron.refit.buckets import DEFAULT_BUCKET_BYTES, BucketLayout, BucketWriter
from rlhf_megatron.refit.export import ExportedTensor, is_stage_sender, iter_hf_tensors
from rlhf_megatron.refit.refit import RefitStats, RolloutClient, refit_rollout
from rlhf_megatron.refit.transports import (
    BroadcastReceiver,
    BroadcastTransport,
    CudaIpcTransport,
    SharedMemoryTransport,
    receive,
)

__all__ = [
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
