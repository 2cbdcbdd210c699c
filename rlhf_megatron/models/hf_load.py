"""Direct load of an HF checkpoint into this rank's Megatron shards, through the mapping table.

Each rank walks its own parameters (its pipeline stage, its TP shard), resolves each global
Megatron name in the architecture's table and lets the mapping read only the rows this shard needs
from safetensors' lazy slices. Nothing is gathered and the full model never sits in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.hf_checkpoint import HFCheckpoint
from rlhf_megatron.models.megatron_layout import global_layer_name, layer_offset_of, mapped_tensors
from rlhf_megatron.models.moe_layers import expert_offset_of
from rlhf_megatron.models.param_mapping import MappingTable, ModelShapes, ShardContext
from rlhf_megatron.models.registry import ARCHITECTURES


@dataclass
class LoadStats:
    """What one rank loaded: parameter count and bytes copied into its shards."""

    params: int = 0
    bytes_loaded: int = 0


def load_hf_weights(
    chunks: Sequence[Any],
    checkpoint: HFCheckpoint,
    table: MappingTable,
    shapes: ModelShapes,
    *,
    tp: int,
    tp_rank: int,
    on_param: Callable[[str], None] | None = None,
    skip: Callable[[str], bool] | None = None,
) -> LoadStats:
    """Copy this rank's shard of every parameter (and mapped buffer) of `chunks` from
    `checkpoint`.

    chunks: this rank's model chunks (GPTModel, optionally wrapped in DDP / Float16Module).
    on_param: called with each global Megatron name once it is loaded (progress bars).
    skip: global Megatron names to leave alone (e.g. a critic's freshly built value head).
    Raises CheckpointError for an unmapped parameter or a shard whose shape disagrees.
    """
    stats = LoadStats()
    ctx = ShardContext(shapes, tp, tp_rank)
    for chunk in chunks:
        offset, experts = layer_offset_of(chunk), expert_offset_of(chunk)
        for local_name, param in mapped_tensors(chunk):
            name = global_layer_name(local_name, offset, experts)
            if skip is not None and skip(name):
                continue
            resolved = table.resolve(name)
            if resolved is None:
                raise CheckpointError(f"no mapping for Megatron parameter {name!r}")
            shard = resolved.hf_to_megatron(checkpoint.open, ctx)
            if shard.shape != param.shape:
                raise CheckpointError(
                    f"{name!r}: the HF tensors give a shard of shape {tuple(shard.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(shard)
            stats.params += 1
            stats.bytes_loaded += shard.numel() * shard.element_size()
            if on_param is not None:
                on_param(name)
    return stats


def load_hf_into_model(chunks: Sequence[Any], hf_dir: str | Path, args: Any) -> LoadStats:
    """`load_hf_weights` for the current Megatron layout; `args` is the MegatronModelArgs.

    Must run after `initialize_layout`; the architecture comes from the checkpoint's config.json.
    """
    from megatron.core import parallel_state

    with HFCheckpoint(hf_dir) as checkpoint:
        spec = ARCHITECTURES.for_hf_config(checkpoint.config)
        return load_hf_weights(
            chunks, checkpoint, spec.mapping_table_for(checkpoint.config),
            ModelShapes.from_megatron_args(args),
            tp=parallel_state.get_tensor_model_parallel_world_size(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        )
