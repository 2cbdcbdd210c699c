"""Write a Megatron torch_dist dist-checkpoint without ever holding the model: every tensor is read
from the HF files (through the mapping table, at TP=1) just before torch DCP writes it.

The model is built on the meta device (no memory), so `model.sharded_state_dict()` gives every
key, shape, dtype and chunk of the checkpoint exactly as `dist_checkpointing.save` would write it
(layer-stacked `decoder.layers.*` keys, the gate/up chunks of a SwiGLU fc1, `_extra_state`
objects). Megatron's `dist_checkpointing.save` then runs with `StreamingTorchDistStrategy`: the
same translation to torch ShardedTensors and the same `MCoreSavePlanner`, but the planner's
`resolve_data` materialises each write item on demand, and torch's synchronous `FileSystemWriter`
with one thread writes items one by one. Peak memory is about one Megatron tensor (plus the HF
tensors it is made of) instead of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.byte_copy import (
    CopyRegistry,
    Extent,
    NotRows,
    RowLayout,
    cut_extents,
    kernel_copy_filesystem,
    trace_rows,
)
from rlhf_megatron.errors import CheckpointError

_LAYERS = "decoder.layers."


class ChunkSource:
    """Materialises one stored chunk (`key`, global offsets and sizes, dtype) from HF tensors.

    resolve(key, size, offsets, sizes, dtype) -> a contiguous tensor of shape `sizes`, cut at
    `offsets` from the stored tensor of global shape `size`. A layer-stacked
    key (`decoder.layers.<name>`) is resolved per layer (`offsets[0]`). The last full Megatron
    tensor is kept while only part of it has been asked for (fc1's gate/up chunks), so no tensor
    is read twice.
    """

    def __init__(self, checkpoint: Any, table: Any, ctx: Any,
                 on_tensor: Callable[[], None] | None = None,
                 registry: CopyRegistry | None = None) -> None:
        self.checkpoint = checkpoint
        self.table = table
        self.ctx = ctx
        self.on_tensor = on_tensor
        # With a registry, chunks made of whole HF rows of the stored dtype are placeholders
        # that the writer fills with in-kernel copies (`byte_copy`).
        self.registry = registry
        self._cached: tuple[str, torch.Tensor] | None = None
        self._extents: tuple[str, list[Extent] | None] | None = None
        self.kernel_tensors = 0
        self.params = 0
        self.bytes = 0
        self.error: CheckpointError | None = None  # the first one raised, for the caller

    def resolve(self, key: str, size: tuple[int, ...], offsets: tuple[int, ...],
                sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        try:
            return self._resolve(key, size, offsets, sizes, dtype)
        except CheckpointError as exc:
            self.error = self.error or exc
            raise

    def _megatron_tensor(self, name: str) -> torch.Tensor:
        if self._cached is not None and self._cached[0] == name:
            return self._cached[1]
        resolved = self.table.resolve(name)
        if resolved is None:
            raise CheckpointError(f"no mapping for Megatron parameter {name!r}")
        tensor = resolved.hf_to_megatron(self.checkpoint.open, self.ctx)
        self.params += 1
        if self.on_tensor is not None:
            self.on_tensor()
        return tensor

    def _resolve(self, key: str, size: tuple[int, ...], offsets: tuple[int, ...],
                 sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        name, stacked = key, False
        rest = key[len(_LAYERS):]
        if key.startswith(_LAYERS) and not rest.split(".")[0].isdigit():
            if sizes[0] != 1:
                raise CheckpointError(f"{key}: a stored chunk spans {sizes[0]} layers")
            name, stacked = f"{_LAYERS}{offsets[0]}.{rest}", True
            size, offsets, sizes = size[1:], offsets[1:], sizes[1:]
        region = self._copied_region(name, size, offsets, sizes, dtype)
        if region is None:
            region = self._computed_region(name, size, offsets, sizes, dtype)
        if stacked:
            region = region.unsqueeze(0)
        self.bytes += region.numel() * region.element_size()
        return region

    def _copied_region(self, name: str, size: tuple[int, ...], offsets: tuple[int, ...],
                       sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A placeholder for the chunk, to be filled by kernel copies; None when the chunk is not
        whole rows of HF tensors of `dtype` (the caller then computes it)."""
        if self.registry is None or not size or tuple(offsets[1:]) != (0,) * (len(size) - 1) \
                or tuple(sizes[1:]) != tuple(size[1:]):
            return None
        if self._extents is None or self._extents[0] != name:
            self._extents = (name, self._trace(name, size, dtype))
            if self._extents[1] is not None:
                self.params += 1
                self.kernel_tensors += 1
                if self.on_tensor is not None:
                    self.on_tensor()
        extents = self._extents[1]
        if extents is None:
            return None
        row_bytes = torch.Size(size[1:]).numel() * torch.empty((), dtype=dtype).element_size()
        part = cut_extents(extents, offsets[0] * row_bytes, (offsets[0] + sizes[0]) * row_bytes)
        return self.registry.placeholder(sizes, dtype, part)

    def _trace(self, name: str, size: tuple[int, ...], dtype: torch.dtype) -> list[Extent] | None:
        resolved = self.table.resolve(name)
        if resolved is None:
            raise CheckpointError(f"no mapping for Megatron parameter {name!r}")
        sources = {role: self.checkpoint.open(hf) for role, hf in resolved.hf_names.items()}
        if any(s.data_start is None for s in sources.values()):
            return None
        layouts = {role: RowLayout.whole(s.shape, s.dtype, Path(s.file), s.data_start)
                   for role, s in sources.items()}
        try:
            return trace_rows(layouts, lambda tracers: {"": resolved.mapping.hf_to_megatron(
                tracers, self.ctx)}, {"": size}, dtype)[""]
        except NotRows:
            return None

    def _computed_region(self, name: str, size: tuple[int, ...], offsets: tuple[int, ...],
                         sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        full = self._megatron_tensor(name)
        if tuple(full.shape) != tuple(size):
            raise CheckpointError(
                f"{name!r}: the HF tensors give a tensor of shape {tuple(full.shape)}, the model "
                f"expects {tuple(size)}"
            )
        whole = tuple(sizes) == tuple(full.shape)
        self._cached = None if whole else (name, full)
        region = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        region = region.to(dtype)
        # A part of the cached tensor gets storage of its own: the planner frees each written
        # item's storage (StreamingSavePlanner), which must not free the cached tensor.
        return region.contiguous() if whole else region.clone(memory_format=torch.contiguous_format)


def _streaming_planner(source: ChunkSource) -> Any:
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    class StreamingSavePlanner(MCoreSavePlanner):
        """`MCoreSavePlanner` whose tensor data comes from `source` at write time.

        torch's writer asks for the next item only after the previous one is written, but keeps
        every written tensor referenced until its file is closed (`tensor_dict` in
        `_write_files_from_queue`). So the storage of the previous item is released here, when
        the next one is asked for: written bytes never accumulate in memory.
        """

        _previous: torch.Tensor | None = None

        def resolve_data(self, write_item: WriteItem) -> Any:
            if self._previous is not None:
                storage = self._previous.untyped_storage()
                if storage.resizable():
                    storage.resize_(0)
                self._previous = None
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            data = write_item.tensor_data
            assert data is not None
            tensor = source.resolve(write_item.index.fqn, tuple(data.size),
                                    tuple(data.chunk.offsets), tuple(data.chunk.sizes),
                                    data.properties.dtype)
            self._previous = tensor
            return tensor

    return StreamingSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)


def streaming_strategy(source: ChunkSource) -> Any:
    """A torch_dist save strategy for `dist_checkpointing.save` that streams from `source`."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class StreamingTorchDistStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
            state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            pyt_state_dict = mcore_to_pyt_state_dict(state_dict, False)
            # One thread: items are resolved and written one at a time. No fsync: the output
            # directory is renamed into place only after the whole save succeeded.
            writer = dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1, sync_files=False,
                                          single_file_per_rank=True)
            if source.registry is not None:
                writer.fs = kernel_copy_filesystem(source.registry)
            # No CRC32 per record (~15% of the save's time here); torch.load, and so
            # Megatron's load, reads such records (see torch.serialization.set_crc32_options).
            crc32 = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
            try:
                dcp.save(pyt_state_dict, storage_writer=writer, planner=_streaming_planner(source),
                         no_dist=True)
                if source.registry is not None:
                    source.registry.check_done()
            except BaseException:
                # torch DCP wraps errors raised while writing in a CheckpointException (a
                # BaseException); surface ours, whose messages are one line.
                if source.error is not None:
                    raise source.error from None
                raise
            finally:
                torch.serialization.set_crc32_options(crc32)

    return StreamingTorchDistStrategy("torch_dist", 1)


def build_meta_model(args: Any) -> Any:
    """The TP=1 GPTModel on the meta device: every shape and dtype, no storage."""
    from rlhf_megatron.models import build_model_chunks

    with torch.device("meta"):
        (model,) = build_model_chunks(args)
    # Every parameter in the stored dtype, as Float16Module makes it for a bf16/fp16 engine
    # (Megatron's torch-norm fallback creates norm weights in fp32 whatever params_dtype says).
    return model.to(args.transformer_config.params_dtype)
