"""`mcore-to-hf`: a converted or trained Megatron dist-checkpoint -> sharded safetensors + index +
config + generation config + tokenizer files. Each weight comes out in the dtype its Megatron tensor
is stored in (fp32 norms of a bf16 checkpoint stay fp32), or all in `--dtype`; a training
checkpoint's optimizer state is skipped.

Streaming: tensor names, shapes and dtypes come from the torch_dist metadata alone, which fixes
the output plan (file by file) before any weight is read. Then each Megatron tensor (one layer's
slice of a stacked `decoder.layers.*` tensor) is read on its own, straight from the `.distcp`
byte ranges the DCP metadata names (`dcp_reader`; no process group needed), mapped to HF tensors by the architecture's table, written and dropped. Peak
memory is about one Megatron tensor plus its HF outputs.

A LoRA actor's checkpoint also stores adapters: `--merge-lora` writes each adapted weight merged
(checkpoint_tools/lora_export.py); without it such a checkpoint is refused, as the HF model
would silently lack the training.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.byte_copy import Extent, FileCopier, NotRows, trace_rows
from checkpoint_tools.common import (
    ASSETS_DIR,
    DTYPES,
    ConvertedMetadata,
    atomic_output_dir,
    check_output_dir,
    is_model_key,
    parse_size,
)
from checkpoint_tools.dcp_reader import DcpReader
from checkpoint_tools.lora_adapters import (
    Adapter,
    find_adapters,
    is_lora_name,
    lora_scale,
    merged_weight,
)
from checkpoint_tools.safetensors_writer import (
    PlannedSafetensorsWriter,
    PlannedTensor,
    assign_shards,
)
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.checkpoint_meta import is_megatron_checkpoint
from rlhf_megatron.models.weights_fingerprint import check_base

_LAYERS = "decoder.layers."


@dataclass(frozen=True)
class SourceTensor:
    """One Megatron parameter in the dist-checkpoint: `key`, and `layer` for stacked keys."""

    megatron_name: str
    key: str
    shape: torch.Size  # of the stored (possibly layer-stacked) tensor
    dtype: torch.dtype
    layer: int | None


def read_dcp_metadata(ckpt_dir: Path) -> Any:
    """The torch DCP `Metadata` of the dist-checkpoint at `ckpt_dir` (a CheckpointError if none)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(ckpt_dir)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"cannot read the dist-checkpoint metadata in {ckpt_dir}: {exc}") from None


def read_tensor_metadata(ckpt_dir: Path, metadata: Any = None, *,
                         model_only: bool = True) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Stored tensor key -> (global shape, dtype), from the torch_dist metadata only.
    `model_only`: leave out optimizer state (a training checkpoint's exp_avg, exp_avg_sq...)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = metadata if metadata is not None else read_dcp_metadata(ckpt_dir)
    return {
        key: (value.size, value.properties.dtype)
        for key, value in metadata.state_dict_metadata.items()
        if isinstance(value, TensorStorageMetadata) and (is_model_key(key) or not model_only)
    }


def source_tensors(ckpt_dir: Path, num_layers: int, metadata: Any = None) -> list[SourceTensor]:
    """Every Megatron parameter stored, layers unstacked, in model order (embedding first)."""
    singles, stacked = [], []
    for key, (shape, dtype) in read_tensor_metadata(ckpt_dir, metadata).items():
        rest = key[len(_LAYERS):]
        if key.startswith(_LAYERS) and not rest.split(".")[0].isdigit():
            if shape[0] != num_layers:
                raise CheckpointError(f"{key} stacks {shape[0]} layers, config says {num_layers}")
            stacked += [SourceTensor(f"{_LAYERS}{i}.{rest}", key, shape, dtype, i)
                        for i in range(num_layers)]
        else:
            singles.append(SourceTensor(key, key, shape, dtype, None))
    stacked.sort(key=lambda s: s.layer)
    first = [s for s in singles if s.key.startswith("embedding.")]
    return first + stacked + [s for s in singles if not s.key.startswith("embedding.")]


def read_source(reader: DcpReader, source: SourceTensor) -> torch.Tensor:
    """Read one parameter (one layer of a stacked tensor) and nothing else: only the stored
    chunks that overlap it are read, each straight into its destination (`DcpReader`)."""
    if source.layer is None:
        offsets, sizes = (0,) * len(source.shape), tuple(source.shape)
    else:
        offsets = (source.layer,) + (0,) * (len(source.shape) - 1)
        sizes = (1, *source.shape[1:])
    try:
        tensor = reader.read_region(source.key, offsets, sizes, source.dtype)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read {source.megatron_name!r} from {reader.ckpt_dir}: "
                              f"{exc}") from None
    return tensor if source.layer is None else tensor[0]


def read_adapter(reader: DcpReader, adapter: Adapter) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's stored A [r, in] and B [out, r]."""
    return read_source(reader, adapter.a), read_source(reader, adapter.b)


def _plan(metadata: ConvertedMetadata, sources: list[SourceTensor], table: Any,
          hf_shapes: dict[str, torch.Size], dtype: torch.dtype | None
          ) -> tuple[list[tuple[SourceTensor, Any, torch.dtype]], list[PlannedTensor]]:
    """(source, mapping, output dtype) per exported Megatron tensor, and the output plan.
    `dtype` None: each HF tensor in its Megatron tensor's stored dtype (or, for a tensor that
    Megatron keeps in another dtype, the one `metadata.export_dtypes` recorded)."""
    work, planned = [], []
    for source in sources:
        resolved = table.resolve(source.megatron_name)
        if resolved is None:
            raise CheckpointError(
                f"{source.megatron_name!r} has no mapping for {metadata.architecture}"
            )
        if not resolved.mapping.export:
            continue
        stored_as = metadata.export_dtypes.get(source.megatron_name)
        out_dtype = dtype or (DTYPES[stored_as] if stored_as else source.dtype)
        work.append((source, resolved, out_dtype))
        for role in resolved.mapping.hf:
            name = resolved.hf_names[role]
            planned.append(PlannedTensor(name, tuple(hf_shapes[name]), out_dtype))
    return work, planned


@dataclass
class LoraMerge:
    """The adapters to merge (HF weight name -> lora_adapters.Adapter), alpha / rank, and the
    reader of the checkpoint that holds them (set once it is open)."""

    adapters: dict[str, Adapter]
    scale: float
    reader: DcpReader | None = None

    def merged(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """HF tensor `name` with its adapter merged, or cast to `dtype` when it has none."""
        adapter = self.adapters.get(name)
        if adapter is None:
            return tensor.to(dtype)
        a, b = read_adapter(self.reader, adapter)
        return merged_weight(tensor, a, b, self.scale, dtype)


def _hf_tensors(reader: DcpReader, source: SourceTensor, resolved: Any, ctx: Any,
                dtype: torch.dtype, merge: LoraMerge | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The (hf_name, tensor) pairs of one Megatron parameter, read and cast to `dtype`, each
    adapted one merged with its adapter."""
    tensor = read_source(reader, source)
    for name, hf_tensor in resolved.megatron_to_hf([tensor], ctx):
        yield name, merge.merged(name, hf_tensor, dtype) if merge else hf_tensor.to(dtype)


def _hf_extents(reader: DcpReader, source: SourceTensor, resolved: Any, ctx: Any,
                shapes: dict[str, torch.Size],
                dtype: torch.dtype) -> dict[str, list[Extent]] | None:
    """Where the bytes of each HF tensor of one Megatron parameter are in the `.distcp` files,
    when they are whole stored rows of `dtype`; None otherwise (read them instead)."""
    layout = reader.row_layout(source.key, source.layer, tuple(source.shape), source.dtype)
    if layout is None:
        return None
    names = [resolved.hf_names[role] for role in resolved.mapping.hf]

    def mapping(tracers: dict[str, Any]) -> dict[str, torch.Tensor]:
        return dict(resolved.megatron_to_hf([tracers["megatron"][:]], ctx))

    try:
        return trace_rows({"megatron": layout}, mapping, {name: shapes[name] for name in names},
                          dtype)
    except NotRows:
        return None


def _page_hints(copies: list[dict[str, list[Extent]] | None]) -> dict[str, tuple[int, int]]:
    """HF name -> (offset in the tensor, source offset) of its biggest in-kernel copy."""
    hints = {}
    for extents in copies:
        for name, ranges in (extents or {}).items():
            source = [e for e in ranges if e.path is not None]
            if source:
                biggest = max(source, key=lambda e: e.nbytes)
                hints[name] = (biggest.dst, biggest.src)
    return hints


def _export(reader: DcpReader, work: list[tuple[SourceTensor, Any, torch.dtype]],
            copies: list[dict[str, list[Extent]] | None], ctx: Any,
            writer: PlannedSafetensorsWriter, on_tensor: Any,
            merge: LoraMerge | None) -> FileCopier:
    """Write every HF tensor in plan order: copied in the kernel where `copies` has its byte
    ranges, read and written otherwise. Returns the `FileCopier` (in-kernel bytes and time)."""
    copier = FileCopier()
    try:
        for (source, resolved, dtype), extents in zip(work, copies):
            if extents is not None:
                for name, ranges in extents.items():
                    writer.copy(name, ranges, copier)
                    on_tensor()
                continue
            for name, tensor in _hf_tensors(reader, source, resolved, ctx, dtype, merge):
                writer.write(name, tensor)
                on_tensor()
    finally:
        copier.close()
    return copier


def convert_mcore_to_hf(
    ckpt_dir: str | Path, out: str | Path, *, max_shard_size: str = "5GB",
    dtype: str | None = None, force: bool = False, progress: bool = True,
    merge_lora: bool = False,
) -> dict[str, Any]:
    """Export a converted or training checkpoint as an HF directory at `out` (optimizer state
    is skipped); returns a small stats dict. `dtype` (fp32 / bf16 / fp16) of the HF weights:
    None writes the checkpoint's stored dtype. `merge_lora`: a LoRA run's checkpoint, with
    each adapted weight merged (required for one; refused for a checkpoint without adapters)."""
    from tqdm import tqdm

    from rlhf_megatron.models import ARCHITECTURES, head_dim_of
    from rlhf_megatron.models.hf_checkpoint import expected_hf_shapes
    from rlhf_megatron.models.param_mapping import ModelShapes, ShardContext

    ckpt_dir, out = Path(ckpt_dir), Path(out)
    check_output_dir(out, force=force)
    max_bytes = parse_size(max_shard_size)
    metadata = ConvertedMetadata.read(ckpt_dir)
    spec = ARCHITECTURES.get(metadata.architecture)
    config = metadata.hf_config_object()
    table = spec.mapping_table_for(config)
    shapes = ModelShapes(config.num_attention_heads, config.num_key_value_heads,
                         head_dim_of(config), metadata.vocab_size, metadata.padded_vocab_size)
    dcp_metadata = read_dcp_metadata(ckpt_dir)
    sources = source_tensors(ckpt_dir, config.num_hidden_layers, dcp_metadata)
    merge = _lora_merge(ckpt_dir, metadata, sources, table, merge_lora)
    out_dtype = DTYPES[dtype or metadata.dtype]  # config.json's
    start = time.perf_counter()
    adapter_metadata, weights_dir = dcp_metadata, ckpt_dir  # where the base weights are
    if metadata.adapters_only:
        weights_dir = Path(metadata.base["path"])
        check_base(ckpt_dir, metadata.base, weights_dir)
        if not is_megatron_checkpoint(weights_dir):
            return _merge_into_hf(ckpt_dir, dcp_metadata, weights_dir, out, merge, metadata,
                                  config, dtype, force=force, progress=progress)
        dcp_metadata = read_dcp_metadata(weights_dir)
        sources = source_tensors(weights_dir, config.num_hidden_layers, dcp_metadata)
    sources = [source for source in sources if not is_lora_name(source.megatron_name)]
    hf_shapes = expected_hf_shapes(config)
    work, planned = _plan(metadata, sources, table, hf_shapes, DTYPES[dtype] if dtype else None)
    with atomic_output_dir(out, force=force) as tmp:
        ctx = ShardContext(shapes)
        with tqdm(total=len(planned), desc="mcore -> hf", unit="tensor", disable=not progress) as bar:
            reader = DcpReader(weights_dir, dcp_metadata)
            adapter_reader = (DcpReader(ckpt_dir, adapter_metadata)
                              if merge and weights_dir != ckpt_dir else reader)
            if merge:
                merge.reader = adapter_reader
            try:
                # Byte ranges first (a few per tensor): they fix each file's header padding.
                # Merged weights are computed, not copied.
                copies = [None if merge and set(resolved.hf_names.values()) & set(merge.adapters)
                          else _hf_extents(reader, source, resolved, ctx, hf_shapes, tensor_dtype)
                          for source, resolved, tensor_dtype in work]
                writer = PlannedSafetensorsWriter(tmp, assign_shards(planned, max_bytes),
                                                  _page_hints(copies))
                copier = _export(reader, work, copies, ctx, writer, lambda: bar.update(1), merge)
            finally:
                reader.close()
                if adapter_reader is not reader:
                    adapter_reader.close()
        writer.close()
        _write_assets(ckpt_dir, tmp, metadata, config, out_dtype)
    return {"hf_tensors": len(planned), "files": len(writer.files),
            "bytes": writer.bytes_written, "seconds": time.perf_counter() - start,
            "kernel_bytes": copier.kernel_bytes, "copy_seconds": copier.seconds}


def _merge_into_hf(ckpt_dir: Path, dcp_metadata: Any, base_dir: Path, out: Path,
                   merge: LoraMerge, metadata: ConvertedMetadata, config: Any, dtype: str | None,
                   *, force: bool, progress: bool) -> dict[str, Any]:
    """--merge-lora of an adapter-only checkpoint whose base is an HF directory: the base's
    safetensors files rewritten one at a time (a file in memory at once), each adapted weight
    merged, every floating tensor in `dtype` when given; then the index, config and tokenizer."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"the LoRA base {base_dir} has no safetensors files")
    start, seen, written, stored = time.perf_counter(), set(), 0, None
    with atomic_output_dir(out, force=force) as tmp:
        merge.reader = DcpReader(ckpt_dir, dcp_metadata)
        try:
            for path in tqdm(files, desc="merge lora", unit="file", disable=not progress):
                tensors = {}
                with safe_open(str(path), "pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (safe_open is no dict)
                        tensor = handle.get_tensor(name)
                        keep = DTYPES[dtype] if dtype and tensor.is_floating_point() \
                            else tensor.dtype
                        tensors[name] = merge.merged(name, tensor, keep)
                        stored = stored or (keep if tensor.is_floating_point() else None)
                        seen.add(name)
                save_file(tensors, str(tmp / path.name), metadata={"format": "pt"})
                written += sum(t.numel() * t.element_size() for t in tensors.values())
        finally:
            merge.reader.close()
        missing = sorted(set(merge.adapters) - seen)
        if missing:
            raise CheckpointError(f"the LoRA base {base_dir} has no {missing[0]} to merge into")
        index = base_dir / "model.safetensors.index.json"
        if index.is_file():
            fields = json.loads(index.read_text())
            fields.setdefault("metadata", {})["total_size"] = written
            (tmp / index.name).write_text(json.dumps(fields, indent=2) + "\n")
        _write_assets(ckpt_dir, tmp, metadata, config, stored or DTYPES[metadata.dtype])
    return {"hf_tensors": len(seen), "files": len(files), "bytes": written,
            "seconds": time.perf_counter() - start, "kernel_bytes": 0, "copy_seconds": 0.0}


def _lora_merge(ckpt_dir: Path, metadata: ConvertedMetadata, sources: list[SourceTensor],
                table: Any, merge_lora: bool) -> LoraMerge | None:
    adapters = find_adapters(sources, table)
    if adapters and not merge_lora:
        raise CheckpointError(f"{ckpt_dir} holds LoRA adapters: pass --merge-lora to write the "
                              "merged model, or export the adapters with lora-to-peft")
    if not merge_lora:
        return None
    if not adapters or metadata.lora is None:
        raise CheckpointError(f"--merge-lora: {ckpt_dir} holds no LoRA adapters")
    return LoraMerge(adapters, lora_scale(metadata.lora, adapters))


def _write_assets(ckpt_dir: Path, out: Path, metadata: ConvertedMetadata, config: Any,
                  dtype: torch.dtype) -> None:
    """Tokenizer files, generation config and config.json as converted. config.json is left as
    it was when its dtype field (`dtype`, or `torch_dtype` before transformers 5) already names
    the written dtype; otherwise that field is set to it."""
    for name in metadata.asset_files:
        source = ckpt_dir / ASSETS_DIR / name
        if not source.is_file():
            raise CheckpointError(f"asset {source} listed in the metadata is missing")
        shutil.copy2(source, out / name)
    config_path = out / "config.json"
    fields = json.loads(config_path.read_text()) if config_path.is_file() else config.to_dict()
    dtype_str = str(dtype).removeprefix("torch.")
    keys = [key for key in ("dtype", "torch_dtype") if key in fields] or ["dtype"]
    if not config_path.is_file() or any(fields.get(key) != dtype_str for key in keys):
        fields.update({key: dtype_str for key in keys})
        config_path.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    if not (out / "generation_config.json").is_file():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(str(out))
