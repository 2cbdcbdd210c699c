"""Read regions of tensors from a torch_dist (torch DCP) checkpoint with one copy per byte.

A DCP item is a `torch.save` zip (uncompressed) at a byte range of a `.distcp` file. Going through
`torch.distributed.checkpoint.load` costs a planner and a metadata pass per call, a read into a
temporary buffer, unpickling into a new storage and a copy into the destination. Here each stored
chunk's zip is located from the checkpoint metadata, its tensor record is found from the zip
directory and checked against the pickled tensor (contiguous, whole storage), and the bytes are
read straight into the destination tensor. Anything unexpected falls back to `torch.load`.
"""

from __future__ import annotations

import io
import itertools
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.byte_copy import RowLayout, RowRun
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.hf_checkpoint import tensor_bytes


class _Window(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start + length) of an open file."""

    def __init__(self, handle: Any, start: int, length: int) -> None:
        self._handle, self._start, self._length, self._pos = handle, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        self._handle.seek(self._start + self._pos)
        got = self._handle.readinto(memoryview(buffer)[:count])
        self._pos += got
        return got


class _Stub:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args


class _TensorHeader(pickle.Unpickler):
    """Unpickles a torch.save `data.pkl` into the arguments of `_rebuild_tensor_v2`, loading
    nothing and importing nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda *args: ("tensor", args)
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        return ("storage", pid)


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _stored_start(window: _Window, info: zipfile.ZipInfo) -> int | None:
    """Where the bytes of an uncompressed zip record start (after its local header)."""
    local = bytearray(4)
    window.seek(info.header_offset + 26)
    if window.readinto(local) != 4:
        return None
    name_len, extra_len = struct.unpack("<HH", local)
    return info.header_offset + 30 + name_len + extra_len


def _chunk_runs(param: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
                element: int, path: Path, data: int) -> list[RowRun]:
    """The row runs of one stored chunk (global `offsets`, `sizes` in a tensor of shape `param`,
    the last dim whole) whose bytes start at `data` of `path`: one run per index of the dims
    before the last two (rows are contiguous along the second-to-last dim only)."""
    if len(param) < 2:
        return [RowRun(offsets[0], offsets[0] + sizes[0], path, data)]
    row_bytes = param[-1] * element
    outer = [range(o, o + s) for o, s in zip(offsets[:-2], sizes[:-2])]
    runs, position = [], data
    for index in itertools.product(*outer):
        flat = 0
        for dim, i in enumerate((*index, offsets[-2])):
            flat = flat * param[dim] + i
        runs.append(RowRun(flat, flat + sizes[-2], path, position))
        position += sizes[-2] * row_bytes
    return runs


class DcpReader:
    """Reads stored chunks of a torch_dist checkpoint at `ckpt_dir`; keeps one file open."""

    def __init__(self, ckpt_dir: Path, metadata: Any) -> None:
        self.ckpt_dir = ckpt_dir
        self.metadata = metadata
        self._handles: dict[str, Any] = {}

    def _handle(self, relative_path: str) -> Any:
        if relative_path not in self._handles:
            self.close()
            self._handles[relative_path] = open(self.ckpt_dir / relative_path, "rb")
        return self._handles[relative_path]

    def read_chunk(self, key: str, chunk: Any, dtype: torch.dtype) -> torch.Tensor:
        """The stored chunk (`chunk.offsets`, `chunk.sizes`) of `key`, as one new tensor."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data[MetadataIndex(key, chunk.offsets)]
        handle = self._handle(info.relative_path)
        sizes = tuple(chunk.sizes)
        out = torch.empty(sizes, dtype=dtype)
        start = self._record_start(_Window(handle, info.offset, info.length), sizes, out.nbytes)
        if start is None:  # not the plain layout: let torch read it
            window = io.BufferedReader(_Window(handle, info.offset, info.length))
            return torch.load(window, weights_only=True).to(dtype).reshape(sizes)
        handle.seek(info.offset + start)
        if out.nbytes and handle.readinto(tensor_bytes(out)) != out.nbytes:
            raise CheckpointError(f"{key}: {info.relative_path} is truncated")
        return out

    @staticmethod
    def _record_start(window: _Window, sizes: tuple[int, ...], nbytes: int) -> int | None:
        """Offset of the tensor bytes inside the item, if it holds exactly one contiguous tensor
        of `sizes` over a whole storage of `nbytes`; None otherwise. Reads the zip directory and
        the small pickle only (no CRC check: `hf-to-mcore` writes records without CRC32)."""
        try:
            infos = zipfile.ZipFile(io.BufferedReader(window)).infolist()
            records = [i for i in infos if "/data/" in i.filename
                       and not i.filename.split("/data/")[-1].startswith(".")]
            pkl = next(i for i in infos if i.filename.endswith("data.pkl"))
            if any(i.compress_type != zipfile.ZIP_STORED for i in (pkl, *records)):
                return None
            start = _stored_start(window, pkl)
            if start is None:
                return None
            raw = bytearray(pkl.file_size)
            window.seek(start)
            if window.readinto(raw) != len(raw):
                return None
            kind, args = _TensorHeader(io.BytesIO(bytes(raw))).load()
        except Exception:
            return None
        if kind != "tensor" or len(records) != 1:
            return None
        storage, offset, size, stride = args[:4]
        if (records[0].file_size != nbytes or offset != 0 or tuple(size) != sizes
                or tuple(stride) != _contiguous_strides(sizes) or storage[0] != "storage"):
            return None
        return _stored_start(window, records[0])

    def row_layout(self, key: str, layer: int | None, shape: tuple[int, ...],
                   dtype: torch.dtype) -> RowLayout | None:
        """Where each row (vector along the last dim; see `RowRun`) of `key` (its layer `layer`
        when layer-stacked, else the whole tensor of global `shape`) is stored: runs of rows per
        stored chunk. None when a chunk splits the last dim or is not a plain record (then read
        it instead)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        lead = 0 if layer is None else 1  # the layer-stack dim, when there is one
        param = tuple(shape[lead:])
        if not param:
            return None
        element = torch.empty((), dtype=dtype).element_size()
        runs: list[RowRun] = []
        for chunk in self.metadata.state_dict_metadata[key].chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if lead and not offsets[0] <= layer < offsets[0] + sizes[0]:
                continue
            if len(param) >= 2 and (offsets[-1] != 0 or sizes[-1] != param[-1]):
                return None
            info = self.metadata.storage_data[MetadataIndex(key, chunk.offsets)]
            window = _Window(self._handle(info.relative_path), info.offset, info.length)
            start = self._record_start(window, sizes, torch.Size(sizes).numel()
                                       * torch.empty((), dtype=dtype).element_size())
            if start is None:
                return None
            local = torch.Size(sizes[lead:]).numel() * element  # the chunk's bytes per layer
            slab = (layer - offsets[0]) * local if lead else 0
            runs += _chunk_runs(param, offsets[lead:], sizes[lead:], element,
                                self.ckpt_dir / info.relative_path, info.offset + start + slab)
        return RowLayout(torch.Size(param), dtype, tuple(sorted(runs, key=lambda r: r.start)))

    def read_region(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                    dtype: torch.dtype) -> torch.Tensor:
        """The region of `key` at `offsets` of `sizes`, assembled from the chunks it overlaps."""
        chunks = self.metadata.state_dict_metadata[key].chunks
        overlapping = [c for c in chunks if all(
            co < o + s and o < co + cs
            for co, cs, o, s in zip(c.offsets, c.sizes, offsets, sizes))]
        if len(overlapping) == 1 and tuple(overlapping[0].offsets) == offsets \
                and tuple(overlapping[0].sizes) == sizes:
            return self.read_chunk(key, overlapping[0], dtype)
        out = torch.empty(sizes, dtype=dtype)
        covered = 0
        for chunk in overlapping:
            data = self.read_chunk(key, chunk, dtype)
            lo = [max(o, co) for o, co in zip(offsets, chunk.offsets)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, chunk.offsets,
                                                               chunk.sizes)]
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            src = tuple(slice(a - co, b - co) for a, b, co in zip(lo, hi, chunk.offsets))
            out[dst] = data[src]
            covered += out[dst].numel()
        if covered != out.numel():
            raise CheckpointError(f"{key}: the stored chunks do not cover the region at {offsets}")
        return out

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
