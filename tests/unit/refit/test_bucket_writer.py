"""BucketWriter: whole layers per bucket, buffer reuse, exact bytes back through views_of."""

import pytest
import torch

from rlhf_megatron.refit.buckets import BucketWriter, layer_bytes_of, views_of
from rlhf_megatron.refit.export import ExportedTensor


def _tensors():
    g = torch.Generator().manual_seed(0)
    items = [ExportedTensor("model.embed_tokens.weight", torch.randn(10, 8, generator=g), None)]
    for layer in range(3):
        for part, shape in (("q", (8, 8)), ("k", (4, 8)), ("mlp", (16, 8))):
            name = f"model.layers.{layer}.{part}.weight"
            items.append(ExportedTensor(name, torch.randn(shape, generator=g), layer))
    items.append(ExportedTensor("model.norm.weight", torch.randn(8, generator=g), None))
    return items


def _run(capacity_bytes: int, layer_bytes: dict[int, int]):
    buffer = torch.zeros(capacity_bytes, dtype=torch.uint8)
    received = []

    def flush(layout):
        received.append([(name, t.clone()) for name, t in views_of(buffer, layout)])

    writer = BucketWriter(buffer, flush, layer_bytes)
    for item in _tensors():
        writer.add(item)
    writer.flush()
    return received


LAYER_BYTES = {layer: (64 + 32 + 128) * 4 + 3 * 64 for layer in range(3)}


def test_every_tensor_arrives_exactly_once_and_bitwise():
    buckets = _run(2048, LAYER_BYTES)
    got = {name: t for bucket in buckets for name, t in bucket}
    expected = {item.name: item.tensor for item in _tensors()}
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert sum(len(b) for b in buckets) == len(expected)


def test_a_decoder_layer_is_never_split_across_buckets():
    buckets = _run(1200, LAYER_BYTES)  # room for one layer (~1 KB) per bucket
    assert len(buckets) >= 3
    for bucket in buckets:
        layers = {name.split(".")[2] for name, _ in bucket if name.startswith("model.layers.")}
        for layer in layers:
            names = [n for n, _ in bucket if n.startswith(f"model.layers.{layer}.")]
            assert len(names) == 3, f"layer {layer} split: {names}"


def test_a_tensor_larger_than_the_buffer_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit the 64-byte bucket"):
        _run(64, {})


def test_layer_bytes_come_from_megatron_shapes_times_tp():
    column = torch.nn.Parameter(torch.zeros(6, 4))
    column.tensor_model_parallel = True
    norm = torch.nn.Parameter(torch.zeros(4))
    named = [("decoder.layers.0.self_attention.linear_qkv.weight", column),
             ("decoder.layers.0.input_layernorm.weight", norm),
             ("embedding.word_embeddings.weight", column)]
    sizes = layer_bytes_of(named, tp=2)
    assert list(sizes) == [0]
    assert sizes[0] >= 6 * 4 * 4 * 2 + 4 * 4  # the gathered qkv plus the norm
