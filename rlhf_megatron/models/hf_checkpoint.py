"""Read an HF checkpoint directory lazily: config.json + safetensors (single file or sharded).

Tensors are opened as `LazyTensor`s over safetensors' lazy slices, so a rank reads only the rows it
slices. Every tensor's shape is checked against the shape config.json implies (from an HF model
built on the meta device, which allocates nothing). All problems raise `CheckpointError` with a
one-line message naming the file or tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def read_safetensors_header(file: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """name -> (shape, dtype) from a safetensors file's JSON header, without mapping the file.

    Raises CheckpointError naming the file when it is missing, corrupt or truncated.
    """
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
            name: (torch.Size(info["shape"]), _SAFETENSORS_DTYPES[info["dtype"]])
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


class LazyTensor:
    """A tensor in a safetensors file; slicing reads only the selected bytes.

    Each read maps the file, copies the slice out and unmaps it again, so pages read for earlier
    tensors do not accumulate in this process's resident memory.
    shape: the stored shape; dtype: the stored torch dtype.
    """

    def __init__(self, file: Path, name: str, shape: torch.Size, dtype: torch.dtype) -> None:
        self.file = file
        self.name = name
        self.shape = shape
        self.dtype = dtype

    @classmethod
    def from_file(cls, file: str | Path, name: str) -> LazyTensor:
        file = Path(file)
        shape, dtype = read_safetensors_header(file)[name]
        return cls(file, name, shape, dtype)

    def __getitem__(self, index: Any) -> torch.Tensor:
        from safetensors import safe_open

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
    return {name: param.shape for name, param in model.state_dict().items()}


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
        self._headers: dict[Path, dict[str, tuple[torch.Size, torch.dtype]]] = {}
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

    def _header(self, file: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(file)
        return self._headers[file]

    def names(self) -> list[str]:
        return list(self._file_of)

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
        shape, dtype = header[name]
        expected = self._expected.get(name)
        if expected is not None and shape != expected:
            raise CheckpointError(
                f"tensor {name!r} in {file.name} has shape {tuple(shape)} but config.json "
                f"implies {tuple(expected)}"
            )
        return LazyTensor(file, name, shape, dtype)

    def close(self) -> None:
        self._headers.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
