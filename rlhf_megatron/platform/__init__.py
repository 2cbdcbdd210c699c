"""Device/backend choice and the CPU compatibility layer for Megatron-Core."""

from rlhf_megatron.platform.cpu_compat import (
    CPU_SHIMS,
    SHIM_NAMES,
    CpuCompatHandle,
    apply_cpu_compat,
)
from rlhf_megatron.platform.device import (
    Platform,
    current_platform,
    return_free_heap_to_os,
    transformer_engine_available,
)

__all__ = [
    "CPU_SHIMS",
    "SHIM_NAMES",
    "CpuCompatHandle",
    "Platform",
    "apply_cpu_compat",
    "current_platform",
    "return_free_heap_to_os",
    "transformer_engine_available",
]
