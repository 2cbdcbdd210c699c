"""`hf-to-mcore`: an HF directory -> a Megatron dist-checkpoint (torch_dist) + metadata + assets.

The save runs as one rank at TP=PP=1: the torch_dist format is layout-free, so the result loads at
any TP/PP whose sizes divide the model. `--tp/--pp` name the layout the checkpoint is meant for:
they are validated against the model (heads, KV heads, FFN, layers) and fix the vocabulary padding
(Megatron pads the vocabulary to a multiple of 128 * tp), which decides which TP sizes can load it.
The weights are stored in the HF checkpoint's own dtypes unless `--dtype` says otherwise: bf16
stays bf16, and each tensor keeps its own dtype (fp32 norms of a bf16 model stay fp32), so
HF -> Megatron -> HF is bit-exact by default. The checkpoint's `dtype` (metadata) is the one
holding most elements.

Memory: streamed (`streaming_save`): the TP=1 model is built on the meta device only for its
sharded state dict, and each tensor is read from the HF files just before it is written, so peak
RSS is about one Megatron tensor (plus the HF tensors it is made of) above the constant.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.common import (
    ASSETS_DIR,
    DTYPES,
    ConvertedMetadata,
    atomic_output_dir,
    check_output_dir,
    copy_hf_assets,
    dtype_name,
    single_rank_group,
)
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.hf_checkpoint import HFCheckpoint, LazyTensor
from rlhf_megatron.models.hf_load import LoadStats
from rlhf_megatron.models.megatron_layout import mapped_tensors


def preflight(checkpoint: HFCheckpoint) -> list[LazyTensor]:
    """Open every tensor the model needs (shape-checked against config.json) before any work.

    Returns the opened tensors (headers only). Raises CheckpointError naming the file or tensor.
    """
    from rlhf_megatron.models.hf_checkpoint import expected_hf_shapes

    tied = bool(getattr(checkpoint.config, "tie_word_embeddings", False))
    names = [n for n in expected_hf_shapes(checkpoint.config) if not (tied and n == "lm_head.weight")]
    return [checkpoint.open(name) for name in names]


def stored_dtype(tensors: list[LazyTensor]) -> str:
    """The dtype name (fp32 / bf16 / fp16) the HF weights are stored in: the one holding most
    elements (a checkpoint may keep a few small tensors in another dtype)."""
    elements: Counter[torch.dtype] = Counter()
    for tensor in tensors:
        elements[tensor.dtype] += tensor.numel()
    dtype = elements.most_common(1)[0][0]
    if dtype not in DTYPES.values():
        raise CheckpointError(f"the HF weights are stored in {dtype}; pass --dtype fp32, bf16 "
                              "or fp16")
    return dtype_name(dtype)


def convert_hf_to_mcore(
    hf_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, dtype: str | None = None,
    force: bool = False, progress: bool = True,
) -> dict[str, Any]:
    """Convert `hf_dir` into a dist-checkpoint at `out`; returns a small stats dict.
    `dtype` (fp32 / bf16 / fp16): what to store; None keeps the HF weights' own dtype."""
    from rlhf_megatron.models import ARCHITECTURES, hf_to_megatron_args
    from rlhf_megatron.parallel import ParallelDims

    hf_dir, out = Path(hf_dir), Path(out)
    check_output_dir(out, force=force)
    if not hf_dir.is_dir():
        raise CheckpointError(f"HF directory {hf_dir} does not exist")
    with HFCheckpoint(hf_dir) as checkpoint:
        config = checkpoint.config
        spec = ARCHITECTURES.for_hf_config(config)
        tensors = preflight(checkpoint)
        keep_own_dtypes = dtype is None
        dtype = dtype or stored_dtype(tensors)
        # Validates heads / KV heads / FFN / layers against the target layout up front.
        target = hf_to_megatron_args(config, spec, ParallelDims(tp * pp, tp=tp, pp=pp),
                                     params_dtype=DTYPES[dtype])
        # Timed from here: the lines above import transformers' and Megatron's code (a constant).
        start = time.perf_counter()
        with single_rank_group(), atomic_output_dir(out, force=force) as tmp:
            ready = time.perf_counter()  # the process group and Megatron's layout are up
            args = hf_to_megatron_args(config, spec, ParallelDims(1), params_dtype=DTYPES[dtype])
            # The model is only built on the meta device for its sharded state dict: no init.
            no_init = dataclasses.replace(args.transformer_config, perform_initialization=False)
            args = dataclasses.replace(args, transformer_config=no_init,
                                       padded_vocab_size=target.padded_vocab_size)
            stats, copier, export_dtypes = _load_and_save(
                checkpoint, spec, args, tmp, progress=progress, keep_own_dtypes=keep_own_dtypes)
            assets = copy_hf_assets(hf_dir, tmp / ASSETS_DIR)
            ConvertedMetadata(
                architecture=spec.hf_architecture, hf_config=config.to_dict(), dtype=dtype,
                vocab_size=args.vocab_size, padded_vocab_size=args.padded_vocab_size,
                asset_files=assets, export_dtypes=export_dtypes,
            ).write(tmp)
            done = time.perf_counter()
    end = time.perf_counter()
    return {"hf_tensors": len(tensors), "params": stats.params, "bytes": stats.bytes_loaded,
            "seconds": end - start, "dtype": dtype,
            "kernel_bytes": copier.kernel_bytes, "copy_seconds": copier.seconds,
            "group_seconds": (ready - start) + (end - done)}


def keep_source_dtypes(model: Any, table: Any, checkpoint: HFCheckpoint) -> int:
    """Give each parameter of the meta `model` the dtype of the HF tensors it is made of, where
    they agree (fused QKV of mixed dtypes keeps the model's); returns how many changed.

    Parameters stored under one layer-stacked key (`decoder.layers.<i>.<name>` for every i)
    must share a dtype: if the layers' sources disagree, the whole key keeps the model's dtype.
    """
    wanted: dict[str, torch.dtype | None] = {}
    for name, _ in mapped_tensors(model):
        resolved = table.resolve(name)
        dtypes = {checkpoint.open(hf).dtype for hf in resolved.hf_names.values()}
        wanted[name] = dtypes.pop() if len(dtypes) == 1 else None
    stacked: dict[str, set] = {}
    for name, dtype in wanted.items():
        stacked.setdefault(re.sub(r"\.\d+\.", ".*.", name), set()).add(dtype)
    changed = 0
    for name, param in mapped_tensors(model):
        dtypes = stacked[re.sub(r"\.\d+\.", ".*.", name)]
        dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
        if dtype is not None and dtype != param.dtype:
            param.data = param.data.to(dtype)
            changed += 1
    return changed


def buffer_export_dtypes(model: Any, table: Any, checkpoint: HFCheckpoint) -> dict[str, str]:
    """Megatron name -> HF dtype name of each mapped buffer whose HF tensor is not fp32: Megatron
    stores a router's expert bias in fp32 whatever the source (`ConvertedMetadata.export_dtypes`
    then gives `mcore-to-hf` the dtype to write it back in)."""
    parameters = {name for name, _ in model.named_parameters()}
    wanted = {}
    for name, _ in mapped_tensors(model):
        if name in parameters:
            continue
        dtypes = {checkpoint.open(hf).dtype for hf in table.resolve(name).hf_names.values()}
        if len(dtypes) == 1 and (dtype := dtypes.pop()) != torch.float32:
            wanted[name] = dtype_name(dtype)
    return wanted


def _load_and_save(checkpoint: HFCheckpoint, spec: Any, args: Any, tmp: Path, *,
                   progress: bool, keep_own_dtypes: bool) -> tuple[LoadStats, Any, dict]:
    """Stream the save; returns the load stats, the `FileCopier` (bytes and time of the
    in-kernel copies) and the buffers' export dtypes. `keep_own_dtypes`: store each tensor in its
    HF sources' dtype (and write the buffers Megatron keeps in fp32 back in theirs)."""
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from checkpoint_tools.byte_copy import CopyRegistry, FileCopier
    from checkpoint_tools.streaming_save import ChunkSource, build_meta_model, streaming_strategy
    from rlhf_megatron.models.param_mapping import ModelShapes, ShardContext

    model = build_meta_model(args)
    table = spec.mapping_table_for(checkpoint.config)
    names = [name for name, _ in mapped_tensors(model)]
    unmapped = [name for name in names if table.resolve(name) is None]
    if unmapped:  # before anything is written
        raise CheckpointError(f"no mapping for Megatron parameter {unmapped[0]!r}")
    export_dtypes = {}
    if keep_own_dtypes:
        keep_source_dtypes(model, table, checkpoint)
        export_dtypes = buffer_export_dtypes(model, table, checkpoint)
    copier = FileCopier()
    with tqdm(total=len(names), desc="hf -> mcore", unit="tensor", disable=not progress) as bar:
        source = ChunkSource(checkpoint, table,
                             ShardContext(ModelShapes.from_megatron_args(args)),
                             on_tensor=lambda: bar.update(1), registry=CopyRegistry(copier))
        try:
            dist_checkpointing.save(model.sharded_state_dict(), str(tmp),
                                    sharded_strategy=streaming_strategy(source))
        finally:
            copier.close()
    return LoadStats(params=source.params, bytes_loaded=source.bytes), copier, export_dtypes
