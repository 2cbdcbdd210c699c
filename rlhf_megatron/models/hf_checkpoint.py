"""Read an HF checkpoint directory lazily: config.json + safetensors (single file or sharded).

Tensors are opened as `LazyTensor`s over safetensors' lazy slices, so a rank reads only the rows it
slices. Every tensor's shape is checked against the shape config.json implies (from an HF model
built on the meta device, which allocates nothing). All problems raise `CheckpointError` with a
one-line message naming the file or tensor.
"""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.mapping_tables import per_expert_checkpoint_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def read_safetensors_layout(file: Path) -> dict[str, tuple[torch.Size, torch.dtype, int]]:
    """name -> (shape, dtype, absolute byte offset of its data) from a safetensors header, without
    mapping the file. Raises CheckpointError naming the file when it is missing, corrupt or
    truncated."""
    if not file.is_file():
        raise CheckpointError(f"missing safetensors file {file}")
    size = file.stat().st_size
    try:
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a file of {size}")
            header = json.loads(handle.read(header_len))
        header.pop("__metadata__", None)
        entries = {
            name: (torch.Size(info["shape"]), _SAFETENSORS_DTYPES[info["dtype"]],
                   8 + header_len + int(info["data_offsets"][0]))
            for name, info in header.items()
        }
        data_end = max((info["data_offsets"][1] for info in header.values()), default=0)
    except Exception as exc:  # struct.error, ValueError, KeyError, TypeError
        raise CheckpointError(f"corrupt safetensors file {file}: {exc}") from None
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"corrupt safetensors file {file}: truncated ({size} bytes, the header needs "
            f"{8 + header_len + data_end})"
        )
    return entries


def read_safetensors_header(file: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """name -> (shape, dtype) from a safetensors file's JSON header (see read_safetensors_layout)."""
    return {name: (shape, dtype) for name, (shape, dtype, _) in read_safetensors_layout(file).items()}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, for `readinto`.

    Made with ctypes rather than `.numpy()`: exporting to numpy pins the storage (it can no longer
    be resized), which would stop the streaming writer from releasing written tensors early.
    """
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def _leading_rows(index: Any, shape: torch.Size) -> tuple[int, int] | None:
    """(start, stop) when `index` selects whole rows along dim 0 (a contiguous byte range)."""
    if len(shape) == 0:
        return None
    if index is Ellipsis:
        index = slice(None)
    if isinstance(index, tuple):
        if not index or any(i != slice(None) and i is not Ellipsis for i in index[1:]):
            return None
        if sum(i is not Ellipsis for i in index) > len(shape):  # too many indices: the slow
            return None  # path raises, as slicing the tensor would
        index = index[0]
    if not isinstance(index, slice) or index.step not in (None, 1):
        return None
    start, stop, _ = index.indices(shape[0])
    return start, max(start, stop)


class LazyTensor:
    """A tensor in a safetensors file; slicing reads only the selected bytes.

    Whole rows along dim 0 (a contiguous byte range; `t[:]`, `t[a:b]`) are read with one
    `readinto` straight into the result, when the data offset is known. Other slices map the file,
    copy the slice out and unmap it again, so pages read for earlier tensors do not accumulate in
    this process's resident memory.
    shape: the stored shape; dtype: the stored torch dtype; data_start: absolute byte offset.
    """

    def __init__(self, file: Path, name: str, shape: torch.Size, dtype: torch.dtype,
                 data_start: int | None = None) -> None:
        self.file = file
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.data_start = data_start

    def _read_rows(self, start: int, stop: int) -> torch.Tensor:
        assert self.data_start is not None
        out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        if out.numel() == 0:
            return out
        row_bytes = out.nbytes // (stop - start)
        try:
            with open(self.file, "rb") as handle:
                handle.seek(self.data_start + start * row_bytes)
                got = handle.readinto(tensor_bytes(out))
        except OSError as exc:
            raise CheckpointError(f"cannot read tensor {self.name!r} from {self.file}: {exc}") from None
        if got != out.nbytes:
            raise CheckpointError(f"cannot read tensor {self.name!r} from {self.file}: truncated")
        return out

    @classmethod
    def from_file(cls, file: str | Path, name: str) -> LazyTensor:
        file = Path(file)
        shape, dtype, data_start = read_safetensors_layout(file)[name]
        return cls(file, name, shape, dtype, data_start)

    def __getitem__(self, index: Any) -> torch.Tensor:
        from safetensors import safe_open

        rows = _leading_rows(index, self.shape) if self.data_start is not None else None
        if rows is not None:
            return self._read_rows(*rows)

        try:
            with safe_open(str(self.file), framework="pt") as handle:
                return handle.get_slice(self.name)[index]
        except Exception as exc:  # safetensors raises its own types for unreadable data
            raise CheckpointError(f"cannot read tensor {self.name!r} from {self.file}: {exc}") from None

    def numel(self) -> int:
        return self.shape.numel()


def expected_hf_shapes(hf_config: Any) -> dict[str, torch.Size]:
    """HF parameter name -> shape implied by `hf_config` (built on the meta device)."""
    import transformers


    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    shapes = {name: param.shape for name, param in model.state_dict().items()}
    # MoE: experts are fused in memory but stored per expert.
    architectures = list(getattr(hf_config, "architectures", None) or [])
    return per_expert_checkpoint_shapes(architectures[0], shapes) if architectures else shapes


def load_hf_config(hf_dir: str | Path) -> Any:
    """transformers' config of `hf_dir`, with a CheckpointError when it is missing or broken."""
    import transformers

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} is not an HF checkpoint: config.json is missing")
    try:
        return transformers.AutoConfig.from_pretrained(str(hf_dir))
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"cannot read {hf_dir / 'config.json'}: {message}") from None


class HFCheckpoint:
    """An HF checkpoint directory opened for lazy, shape-checked reads.

    Usage: `with HFCheckpoint(path) as ckpt: t = ckpt.open("model.norm.weight")[:]`.
    Parsed headers are cached on this object; no file stays mapped between reads.
    """

    def __init__(self, hf_dir: str | Path, *, check_shapes: bool = True) -> None:
        self.path = Path(hf_dir)
        self.config = load_hf_config(self.path)
        self._headers: dict[Path, dict[str, tuple[torch.Size, torch.dtype, int]]] = {}
        self._file_of = self._weight_map()
        self._expected = expected_hf_shapes(self.config) if check_shapes else {}

    def _weight_map(self) -> dict[str, Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"corrupt index {index}: {exc}") from None
            return {name: self.path / file for name, file in weight_map.items()}
        single = self.path / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path}")
        return {name: single for name in self._header(single)}

    def _header(self, file: Path) -> dict[str, tuple[torch.Size, torch.dtype, int]]:
        if file not in self._headers:
            self._headers[file] = read_safetensors_layout(file)
        return self._headers[file]

    def names(self) -> list[str]:
        return list(self._file_of)

    def files(self) -> list[Path]:
        """Every safetensors file the checkpoint names, sorted."""
        return sorted(set(self._file_of.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def open(self, name: str) -> LazyTensor:
        """The lazy tensor `name`, its shape checked against config.json (reads no data)."""
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is missing from {self.path}")
        file = self._file_of[name]
        header = self._header(file)
        if name not in header:
            raise CheckpointError(f"tensor {name!r} is missing from {file} (the index names it)")
        shape, dtype, data_start = header[name]
        expected = self._expected.get(name)
        if expected is not None and shape != expected:
            raise CheckpointError(
                f"tensor {name!r} in {file.name} has shape {tuple(shape)} but config.json "
                f"implies {tuple(expected)}"
            )
        return LazyTensor(file, name, shape, dtype, data_start)

    def close(self) -> None:
        self._headers.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
