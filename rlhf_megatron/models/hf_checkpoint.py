"""Read an HF checkpoint directory lazily: config.json + safetensors (single file or sharded).

Tensors are opened as `LazyTensor`s over safetensors' lazy slices, so a rank reads only the rows it
slices. Every tensor's shape is checked against the shape config.json implies (from an HF model
built on the meta device, which allocates nothing). All problems raise `CheckpointError` with a
one-line message naming the file or tensor.
"""

from __future__ import annotations

import json
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


class LazyTensor:
    """A tensor in a safetensors file; slicing reads only the selected bytes.

    shape: the stored shape; dtype: the stored torch dtype.
    """

    def __init__(self, raw_slice: Any, name: str, file: Path) -> None:
        self._slice = raw_slice
        self.name = name
        self.file = file
        self.shape = torch.Size(raw_slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(raw_slice.get_dtype(), torch.float32)

    def __getitem__(self, index: Any) -> torch.Tensor:
        try:
            return self._slice[index]
        except Exception as exc:  # safetensors raises its own types for truncated data
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
    File handles live on this object and are closed by `close()` / the context manager.
    """

    def __init__(self, hf_dir: str | Path, *, check_shapes: bool = True) -> None:
        self.path = Path(hf_dir)
        self.config = load_hf_config(self.path)
        self._file_of = self._weight_map()
        self._handles: dict[Path, Any] = {}
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
        return {name: single for name in self._handle(single).keys()}

    def _handle(self, file: Path) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            if not file.is_file():
                raise CheckpointError(f"missing safetensors file {file}")
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as exc:
                raise CheckpointError(f"corrupt safetensors file {file}: {exc}") from None
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def open(self, name: str) -> LazyTensor:
        """The lazy tensor `name`, its shape checked against config.json."""
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is missing from {self.path}")
        file = self._file_of[name]
        handle = self._handle(file)
        try:
            tensor = LazyTensor(handle.get_slice(name), name, file)
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {name!r} from {file}: {exc}") from None
        expected = self._expected.get(name)
        if expected is not None and tensor.shape != expected:
            raise CheckpointError(
                f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)} but config.json "
                f"implies {tuple(expected)}"
            )
        return tensor

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
