"""Move tensor bytes file to file inside the kernel (`os.copy_file_range`), at their offsets.

Most of a conversion changes no byte: with the dtype kept, every output tensor is a sequence of
whole rows of input tensors (each query group's q rows, then its k and v rows for Megatron's fused
QKV; gate then up for fc1; the vocabulary rows then zero padding for the embedding). Which rows
is found by running the architecture's own mapping (`ParamMapping`) on *row tracers*: stand-ins
for the source tensors whose "values" are row ids, of shape (rows, 1, ..., 1), so the mapping's
torch ops permute, cut and pad row ids instead of data (a few bytes per row). The result is a
list of `Extent`s (output byte range <- input file byte range, or zeros), copied with
`copy_file_range`. A mapping that does more than move whole rows (a transpose, a split along a
later dim, a cast) is detected (the traced shape is not (rows, 1, ...)) and the caller falls back
to reading the tensor through user space.

`KernelCopyFileSystem` plugs the copies into torch DCP's `FileSystemWriter` (torch_dist): the save
planner hands the writer an untouched placeholder tensor registered with `CopyRegistry`, torch
writes its zip record as usual (header, alignment, directory, metadata all torch's own), and when
the record's data bytes (one `write` of the placeholder's memory) reach the stream, the stream
copies the extents into the file at that offset instead. The placeholder's pages are never
touched, so they cost no resident memory.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_megatron.errors import CheckpointError

_USER_SPACE_CHUNK = 16 * 2**20
_PAGE = 4096
# copy_file_range refused for these files (another file system, an old kernel): copy via user space.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF}


@dataclass(frozen=True)
class RowRun:
    """Rows [start, stop) of a tensor, stored contiguously in `path` from byte `offset`. A row is
    one vector along the last dim (an element of a 1-D tensor), counted in storage order."""

    start: int
    stop: int
    path: Path
    offset: int


@dataclass(frozen=True)
class RowLayout:
    """Where every row (index along dim 0) of a tensor of `shape` and `dtype` is stored."""

    shape: torch.Size
    dtype: torch.dtype
    runs: tuple[RowRun, ...]

    @property
    def row_bytes(self) -> int:
        last = self.shape[-1] if len(self.shape) >= 2 else 1
        return last * torch.empty((), dtype=self.dtype).element_size()

    @property
    def rows_per_index(self) -> int:
        """Rows per index along dim 0: 1 for 1-D and 2-D tensors, E.g. R for (E, R, H)."""
        return torch.Size(self.shape[1:-1]).numel() if len(self.shape) >= 2 else 1

    @classmethod
    def whole(cls, shape: torch.Size, dtype: torch.dtype, path: Path, offset: int) -> RowLayout:
        """A tensor stored contiguously from byte `offset` of `path`."""
        layout = cls(torch.Size(shape), dtype, ())
        rows = int(shape[0]) * layout.rows_per_index if len(shape) else 0
        return cls(layout.shape, dtype, (RowRun(0, rows, path, offset),))


@dataclass(frozen=True)
class Extent:
    """`nbytes` bytes of an output tensor at byte `dst` (relative to the tensor's first byte):
    from `path` at absolute byte `src`, or zeros when `path` is None."""

    dst: int
    nbytes: int
    path: Path | None
    src: int


class NotRows(Exception):
    """The mapping does something other than move whole rows: use the user-space path."""


class _RowTracer:
    """A `Sliceable` stand-in for one source tensor: slicing (along dim 0) returns its row ids
    (+ `base` + 1, so that 0 marks a zero row), shaped like the slice with the last dim 1."""

    def __init__(self, shape: torch.Size, base: int) -> None:
        self.shape = torch.Size(shape)
        self.base = base

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(self.shape) == 0 or len(index) > len(self.shape):
            raise NotRows("scalar or over-indexed source")
        start, stop = 0, self.shape[0]
        for dim, item in enumerate(index):
            if not isinstance(item, slice) or item.step not in (None, 1):
                raise NotRows(f"index {item!r}")
            lo, hi, _ = item.indices(self.shape[dim])
            if dim == 0:
                start, stop = lo, max(lo, hi)
            elif (lo, hi) != (0, self.shape[dim]):
                raise NotRows(f"a part of dim {dim}")
        inner = torch.Size(self.shape[1:-1]).numel() if len(self.shape) >= 2 else 1
        ids = torch.arange(start * inner, stop * inner, dtype=torch.int64) + (self.base + 1)
        return ids.reshape(_id_shape((stop - start, *self.shape[1:])))


def _id_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the row ids of a tensor of `shape`: its own, the last dim 1 (for >= 2-D)."""
    return tuple(shape) if len(shape) < 2 else (*shape[:-1], 1)


def trace_rows(layouts: dict[str, RowLayout],
               mapping: Callable[[dict[str, _RowTracer]], dict[str, torch.Tensor]],
               out_shapes: dict[str, Sequence[int]],
               out_dtype: torch.dtype) -> dict[str, list[Extent]]:
    """Run `mapping` on row tracers of `layouts` (role -> source) and turn each output (name ->
    tensor of row ids) into extents. Raises NotRows when an output is not made of whole source
    rows of the same dtype and row size as its own."""
    tracers, owners, base = {}, [], 0
    for role, layout in layouts.items():
        if layout.dtype != out_dtype:
            raise NotRows(f"{role}: {layout.dtype} -> {out_dtype} needs a cast")
        tracers[role] = _RowTracer(layout.shape, base)
        owners.append((base, layout))
        # a gap after each source: no run of ids crosses two sources
        base += (int(layout.shape[0]) * layout.rows_per_index if len(layout.shape) else 0) + 1
    try:
        outputs = mapping(tracers)
    except NotRows:
        raise
    except Exception as exc:  # a mapping that needs more than rows (dtype, values): not ours
        raise NotRows(f"the mapping did not run on row ids: {type(exc).__name__}: {exc}") from None
    extents = {}
    for name, ids in outputs.items():
        shape = tuple(out_shapes[name])
        if len(shape) == 0 or tuple(ids.shape) != _id_shape(shape):
            raise NotRows(f"{name}: traced shape {tuple(ids.shape)} for {shape}")
        extents[name] = _extents(ids.reshape(-1).numpy(), owners, shape, out_dtype)
    return extents


def _extents(ids: np.ndarray, owners: list[tuple[int, RowLayout]], shape: tuple[int, ...],
             dtype: torch.dtype) -> list[Extent]:
    row_bytes = RowLayout(torch.Size(shape), dtype, ()).row_bytes
    if len(ids) == 0:
        return []
    zero = ids == 0
    breaks = np.ones(len(ids), dtype=bool)
    breaks[1:] = (zero[1:] != zero[:-1]) | (~zero[1:] & (ids[1:] != ids[:-1] + 1))
    starts = np.flatnonzero(breaks)
    stops = np.append(starts[1:], len(ids))
    out: list[Extent] = []
    for first, last in zip(starts.tolist(), stops.tolist()):
        if zero[first]:
            out.append(Extent(first * row_bytes, (last - first) * row_bytes, None, 0))
            continue
        base, layout = max((o for o in owners if o[0] < ids[first]), key=lambda o: o[0])
        if (len(layout.shape) >= 2) != (len(shape) >= 2) or layout.row_bytes != row_bytes:
            raise NotRows(f"rows of {tuple(layout.shape)} into rows of {shape}")
        row = int(ids[first]) - base - 1
        out += _locate(layout, row, row + last - first, first * row_bytes)
    return out


def _locate(layout: RowLayout, start: int, stop: int, dst: int) -> list[Extent]:
    """Extents of source rows [start, stop) of `layout`, placed from output byte `dst`."""
    out, row_bytes = [], layout.row_bytes
    for run in layout.runs:
        lo, hi = max(start, run.start), min(stop, run.stop)
        if lo < hi:
            out.append(Extent(dst + (lo - start) * row_bytes, (hi - lo) * row_bytes, run.path,
                              run.offset + (lo - run.start) * row_bytes))
    if sum(e.nbytes for e in out) != (stop - start) * row_bytes:
        raise NotRows(f"rows {start}:{stop} are not all stored")
    return out


def cut_extents(extents: list[Extent], lo: int, hi: int) -> list[Extent]:
    """The part of `extents` covering output bytes [lo, hi), rebased to start at 0."""
    out = []
    for e in extents:
        a, b = max(lo, e.dst), min(hi, e.dst + e.nbytes)
        if a < b:
            out.append(Extent(a - lo, b - a, e.path, e.src + (a - e.dst)))
    return out


class FileCopier:
    """Copies extents into an open output file with `copy_file_range`; keeps source fds open."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self.kernel_bytes = 0
        self.user_bytes = 0
        self.seconds = 0.0  # spent in copy(): the data movement, for the phase breakdown

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def copy(self, dst_fd: int, dst_offset: int, extents: list[Extent]) -> None:
        """Write every extent at `dst_offset + extent.dst` of `dst_fd` (file position unused)."""
        start = time.perf_counter()
        try:
            self._copy(dst_fd, dst_offset, extents)
        finally:
            self.seconds += time.perf_counter() - start

    def _copy(self, dst_fd: int, dst_offset: int, extents: list[Extent]) -> None:
        for e in extents:
            if e.path is None:
                self._zeros(dst_fd, dst_offset + e.dst, e.nbytes)
            else:
                self._range(self._fd(e.path), e.src, dst_fd, dst_offset + e.dst, e.nbytes, e.path)

    def _range(self, src_fd: int, src: int, dst_fd: int, dst: int, count: int, path: Path) -> None:
        done = 0
        while done < count:
            try:
                got = os.copy_file_range(src_fd, dst_fd, count - done, src + done, dst + done)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise CheckpointError(f"cannot copy from {path}: {exc}") from None
                self._user_space(src_fd, src + done, dst_fd, dst + done, count - done, path)
                return
            if got == 0:
                raise CheckpointError(f"{path} is truncated (byte {src + done} is past its end)")
            done += got
        self.kernel_bytes += count

    def _user_space(self, src_fd: int, src: int, dst_fd: int, dst: int, count: int,
                    path: Path) -> None:
        for step in range(0, count, _USER_SPACE_CHUNK):
            size = min(_USER_SPACE_CHUNK, count - step)
            data = os.pread(src_fd, size, src + step)
            if len(data) != size:
                raise CheckpointError(f"{path} is truncated (byte {src + step + len(data)})")
            os.pwrite(dst_fd, data, dst + step)
        self.user_bytes += count

    def _zeros(self, dst_fd: int, dst: int, count: int) -> None:
        block = bytes(min(count, _USER_SPACE_CHUNK))
        for step in range(0, count, len(block)):
            os.pwrite(dst_fd, block[: min(len(block), count - step)], dst + step)
        self.user_bytes += count

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class CopyRegistry:
    """Placeholder tensors whose bytes are to be copied in the kernel when torch writes them.

    `placeholder(shape, dtype, extents)` returns an uninitialised tensor; the stream that receives
    its memory in a `write` copies `extents` instead. `check_done()` fails if any placeholder's
    bytes were not all copied (they would otherwise be garbage in the file)."""

    def __init__(self, copier: FileCopier) -> None:
        self.copier = copier
        self._pending: dict[int, tuple[torch.Tensor, list[Extent], int]] = {}
        self._unplaced: int | None = None  # the newest placeholder, before its record starts

    def placeholder(self, shape: Sequence[int], dtype: torch.dtype,
                    extents: list[Extent]) -> torch.Tensor:
        tensor = torch.empty(tuple(shape), dtype=dtype)
        assert sum(e.nbytes for e in extents) == tensor.nbytes, "extents must cover the tensor"
        if tensor.nbytes:
            self._pending[tensor.data_ptr()] = (tensor, extents, 0)
            self._unplaced = tensor.data_ptr()
        return tensor

    def take_unplaced(self) -> tuple[torch.Tensor, list[Extent]] | None:
        """The newest placeholder if nothing of it was written yet (its record is about to
        start), once; the stream then chooses where the record starts."""
        key, self._unplaced = self._unplaced, None
        entry = self._pending.get(key) if key is not None else None
        return None if entry is None or entry[2] else (entry[0], entry[1])

    def claim(self, address: int, nbytes: int) -> list[Extent] | None:
        """The extents for a write of `nbytes` from `address`, if it is (part of) a placeholder."""
        for start, (tensor, extents, copied) in self._pending.items():
            if start <= address < start + tensor.nbytes:
                lo = address - start
                assert lo + nbytes <= tensor.nbytes, "a write past a placeholder's end"
                if copied + nbytes == tensor.nbytes:
                    del self._pending[start]
                else:
                    self._pending[start] = (tensor, extents, copied + nbytes)
                return cut_extents(extents, lo, lo + nbytes)
        return None

    def check_done(self) -> None:
        if self._pending:
            raise CheckpointError(f"{len(self._pending)} tensor(s) were not copied by the writer")


class _DryRun(io.RawIOBase):
    """Counts the bytes torch.save writes; notes where the tensor's own bytes would go."""

    def __init__(self, address: int) -> None:
        self.position, self.data_at, self._address = 0, -1, address

    def writable(self) -> bool:
        return True

    def write(self, buffer: Any) -> int:
        address, nbytes = _address(buffer)
        if address == self._address and self.data_at < 0:
            self.data_at = self.position
        self.position += nbytes
        return nbytes


def _record_padding(position: int, tensor: torch.Tensor, extents: list[Extent]) -> int:
    """Zero bytes to put before the next DCP item (a torch.save zip of `tensor`) so that its
    biggest extent lands at the same offset modulo the page size as its source: the kernel copies
    page-congruent ranges ~1.5x faster than misaligned ones. Items are read by (offset, length)
    from the metadata, so bytes between items belong to none. < 4 KiB per item."""
    source = [e for e in extents if e.path is not None]
    if not source:
        return 0
    biggest = max(source, key=lambda e: e.nbytes)
    dry = _DryRun(tensor.data_ptr())
    torch.save(tensor, dry)  # the placeholder's memory is passed on, never read
    if dry.data_at < 0:
        return 0
    return (biggest.src - (position + dry.data_at + biggest.dst)) % _PAGE


def _address(buffer: Any) -> tuple[int, int]:
    view = memoryview(buffer)
    if view.nbytes == 0:
        return 0, 0
    return int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data), view.nbytes


class _KernelCopyStream(io.RawIOBase):
    """A binary output file whose writes of registered placeholders become kernel copies."""

    def __init__(self, path: Path, registry: CopyRegistry) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._registry = registry

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        """The position, after padding when the next record holds a placeholder (see
        `_record_padding`): DCP reads the position here as the start of the next item."""
        position = self._file.tell()
        unplaced = self._registry.take_unplaced()
        if unplaced is not None:
            pad = _record_padding(position, *unplaced)
            if pad:
                self._file.write(bytes(pad))
                position += pad
        return position

    def write(self, buffer: Any) -> int:
        address, nbytes = _address(buffer)
        extents = self._registry.claim(address, nbytes) if nbytes else None
        if extents is None:
            return self._file.write(buffer)
        self._file.flush()
        position = self._file.tell()
        self._registry.copier.copy(self._file.fileno(), position, extents)
        self._file.seek(position + nbytes)
        return nbytes

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def kernel_copy_filesystem(registry: CopyRegistry) -> Any:
    """A torch DCP `FileSystem` whose `.distcp` output streams copy placeholders in the kernel."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class KernelCopyFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            if mode != "wb" or not str(path).endswith(".distcp"):
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            stream = _KernelCopyStream(Path(path), registry)
            try:
                yield stream
            finally:
                stream.close()

    return KernelCopyFileSystem()
