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
    half = torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.bfloat16))
    named = [("decoder.layers.0.self_attention.linear_qkv.weight", column),
             ("decoder.layers.0.input_layernorm.weight", norm),
             ("decoder.layers.1.mlp.linear_fc2.weight", half),
             ("embedding.word_embeddings.weight", column)]
    # Each param: its TP-gathered bytes rounded up to 64, plus 2 x 64 for the up to 3 aligned HF
    # tensors a fused param becomes. Layer 0 at tp=2: qkv 6*4*2 fp32 = 192 -> 192 + 128;
    # norm 16 -> 64 + 128. Layer 1: 15 bf16 = 30 -> 64 + 128 (not TP-split). No embedding.
    assert layer_bytes_of(named, tp=2) == {0: 320 + 192, 1: 192}
    # tp=1: qkv 96 -> 128 + 128.
    assert layer_bytes_of(named, tp=1) == {0: 256 + 192, 1: 192}


def test_layer_bytes_cover_the_split_tensors_the_writer_really_writes():
    """The estimate of a fused qkv + norm layer bounds the bytes its HF tensors take."""
    column = torch.nn.Parameter(torch.zeros(6, 4))
    column.tensor_model_parallel = True
    norm = torch.nn.Parameter(torch.zeros(4))
    (estimate,) = layer_bytes_of([("decoder.layers.0.a.weight", column),
                                  ("decoder.layers.0.b.weight", norm)], tp=2).values()
    # The gathered (12, 4) qkv as three HF tensors of 5, 5 and 2 rows, plus the norm.
    pieces = [torch.ones(5, 4), torch.ones(5, 4), torch.ones(2, 4), torch.ones(4)]
    buckets = []
    writer = BucketWriter(torch.zeros(4096, dtype=torch.uint8), buckets.append, {0: estimate})
    for index, piece in enumerate(pieces):
        writer.add(ExportedTensor(f"model.layers.0.p{index}.weight", piece, 0))
    writer.flush()
    (layout,) = buckets
    assert layout.nbytes == 128 + 128 + 64 + 64  # 80, 80, 32, 16 bytes, each aligned to 64
    assert layout.nbytes <= estimate == 512


def test_bucket_sizes_and_offsets_are_exact():
    buckets = []
    writer = BucketWriter(torch.zeros(2048, dtype=torch.uint8), buckets.append, LAYER_BYTES)
    for item in _tensors():
        writer.add(item)
    writer.flush()
    # embedding 320 B; each layer: q 256 + k 128 + mlp 512 = 896 B (estimated 1088); norm 32 B.
    # Bucket 0: embedding + layer 0 (320 + 1088 fits 2048), layer 1's estimate does not fit.
    # Bucket 1: layers 1 and 2 (896 + 1088 <= 2048) and the norm, padded to 64.
    assert [b.nbytes for b in buckets] == [320 + 896, 896 + 896 + 64]
    assert [len(b.specs) for b in buckets] == [4, 7]
    assert [s.offset for s in buckets[0].specs] == [0, 320, 576, 704]
    assert all(s.offset % 64 == 0 for b in buckets for s in b.specs)
    assert [b.index for b in buckets] == [0, 1]
