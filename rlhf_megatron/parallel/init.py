"""Bring up torch.distributed and Megatron's parallel_state from a ParallelDims, and tear down.

Order matters: the platform (device, backend, CPU shims) first, then the default process group,
then Megatron's groups, then the model-parallel RNG seeds (which need the groups).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from rlhf_megatron.errors import LayoutError
from rlhf_megatron.parallel.dims import ParallelDims
from rlhf_megatron.platform import CpuCompatHandle, apply_cpu_compat, current_platform


def initialize_distributed(timeout_minutes: int = 10) -> None:
    """Create the default process group from the torchrun-style environment, if not yet done.

    Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; LOCAL_RANK picks the GPU.
    """
    if dist.is_initialized():
        return
    platform = current_platform()
    if platform.is_cuda:
        torch.cuda.set_device(platform.device())
    dist.init_process_group(
        backend=platform.backend,
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )


def initialize_layout(
    dims: ParallelDims, *, seed: int = 1234, skip_cpu_shims: Iterable[str] = ()
) -> CpuCompatHandle:
    """Initialise Megatron's parallel_state for `dims` on the current default process group.

    The world size must equal `dims.world_size`. Call `destroy_layout()` before another layout.
    `skip_cpu_shims` leaves named CPU shims out (diagnosis and the tests that prove each is needed).
    Returns the handle of the CPU shims this call applied (empty on GPU or when already applied).
    """
    from megatron.core import parallel_state, tensor_parallel

    platform = current_platform()
    # cp > 1 runs on every platform: through TE attention where TE is usable, else through the
    # SDPA core attention's all-gather-KV path (models/sdpa_cp.py); the model builder refuses
    # it only for Megatron's unfused local attention.
    shims = apply_cpu_compat(platform, skip=skip_cpu_shims)
    initialize_distributed()
    if dist.get_world_size() != dims.world_size:
        raise LayoutError(
            f"layout {dims.describe()} wants {dims.world_size} ranks, "
            f"but torch.distributed has {dist.get_world_size()}"
        )
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("a parallel layout is already initialised; call destroy_layout() first")
    global _GROUPS_BEFORE
    _GROUPS_BEFORE = _process_groups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.pp > 1 else None,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        # On CPU every group already uses gloo; extra gloo copies would only cost time.
        create_gloo_process_groups=platform.is_cuda,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return shims


def destroy_layout() -> None:
    """Destroy Megatron's groups and global buffers, keeping the default process group.

    Lets one process run several layouts in sequence (tests, layout-parity checks).
    """
    from megatron.core import parallel_state

    global _GROUPS_BEFORE
    if parallel_state.model_parallel_is_initialized():
        if dist.is_initialized():
            dist.barrier()
        layout_groups = _process_groups() - _GROUPS_BEFORE
        parallel_state.destroy_model_parallel()
        _drop_references_to(layout_groups)
        # Megatron forgets its groups but torch keeps them, each gloo group with its threads:
        # a process that walked 25 layouts held ~1,500 threads per rank, and every later
        # group's rendezvous slowed (session 9's CI: the parity job 730 s, ~60 s otherwise).
        for group in layout_groups:
            dist.destroy_process_group(group)
    _GROUPS_BEFORE = set()


def _drop_references_to(groups: set) -> None:
    """What Megatron 0.16 keeps past `destroy_model_parallel`, which keeps the layout's groups
    (and each gloo group's threads) alive: `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` (and its
    gloo twin) are never reset; the MoE aux-loss tracker holds its reduce groups; and
    `RotaryEmbedding.forward` is an `lru_cache` on the method, so it holds every rotary module
    (with its cp_group) it has seen. Measured: 3 gloo threads a layout per rank, after the
    layout's models were freed; none with this."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import (
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )
    from megatron.core.transformer.moe import moe_utils

    for name, value in list(vars(parallel_state).items()):
        if any(value is group for group in groups):
            setattr(parallel_state, name, None)
    moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER.clear()
    rotary_pos_embedding.RotaryEmbedding.forward.cache_clear()
    yarn_rotary_pos_embedding.YarnRotaryEmbedding.forward.cache_clear()


_GROUPS_BEFORE: set = set()
"""The process groups that existed before initialize_layout (the default one and the caller's):
destroy_layout destroys the rest, those the layout made."""


def _process_groups() -> set:
    """Every live process group of this process (empty before torch.distributed starts)."""
    if not dist.is_initialized():
        return set()
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


@contextlib.contextmanager
def parallel_layout(
    dims: ParallelDims, *, seed: int = 1234, skip_cpu_shims: Iterable[str] = ()
) -> Iterator[ParallelDims]:
    """`with parallel_layout(dims):` initialises the layout and always destroys it afterwards,
    and takes back the CPU shims it applied, leaving the process as it found it."""
    shims = initialize_layout(dims, seed=seed, skip_cpu_shims=skip_cpu_shims)
    try:
        yield dims
    finally:
        destroy_layout()
        shims.remove()
