"""Parallel layouts: ParallelDims and Megatron process-group set-up / teardown."""

from rlhf_megatron.parallel.dims import ParallelDims
from rlhf_megatron.parallel.init import (
    destroy_layout,
    initialize_distributed,
    initialize_layout,
    parallel_layout,
)

__all__ = [
    "ParallelDims",
    "destroy_layout",
    "initialize_distributed",
    "initialize_layout",
    "parallel_layout",
]
