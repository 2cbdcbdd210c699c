"""In-kernel conversion copies (`checkpoint_tools/byte_copy.py`): the row tracing through the
mapping table must give exactly the bytes the mapping computes, refuse what is not whole rows, and
the DCP writer stream must produce records torch reads back, never leaving a placeholder unfilled."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_tools.byte_copy import (
    CopyRegistry,
    Extent,
    FileCopier,
    NotRows,
    RowLayout,
    RowRun,
    trace_rows,
)
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.hf_checkpoint import LazyTensor
from rlhf_megatron.models.param_mapping import (
    GatedMLPMapping,
    ModelShapes,
    QKVMapping,
    RowParallelMapping,
    ShardContext,
    VocabParallelMapping,
)

SHAPES = ModelShapes(num_attention_heads=4, num_query_groups=2, head_dim=3, vocab_size=10,
                     padded_vocab_size=16)
HIDDEN = 5


def _hf_file(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, LazyTensor]:
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return {name: LazyTensor.from_file(path, name) for name in tensors}


def _layout(lazy: LazyTensor) -> RowLayout:
    run = RowRun(0, lazy.shape[0], lazy.file, lazy.data_start)
    return RowLayout(lazy.shape, lazy.dtype, (run,))


def _copied(extents, nbytes: int, tmp_path: Path) -> bytes:
    out = tmp_path / "out.bin"
    out.write_bytes(b"\xff" * nbytes)  # zero extents must really write zeros
    copier = FileCopier()
    with open(out, "r+b") as handle:
        copier.copy(handle.fileno(), 0, extents)
    copier.close()
    return out.read_bytes()


@pytest.mark.parametrize("mapping, roles, shapes", [
    (QKVMapping("qkv", q="q", k="k", v="v"), ("q", "k", "v"),
     [(12, HIDDEN), (6, HIDDEN), (6, HIDDEN)]),
    (QKVMapping("qkv_bias", q="q", k="k", v="v"), ("q", "k", "v"), [(12,), (6,), (6,)]),
    (GatedMLPMapping("fc1", gate="g", up="u"), ("gate", "up"), [(7, HIDDEN), (7, HIDDEN)]),
    (VocabParallelMapping("emb", "e"), ("weight",), [(10, HIDDEN)]),  # 6 zero rows of padding
], ids=["qkv", "qkv-bias", "gated-fc1", "vocab-padded"])
def test_traced_extents_give_the_mapping_result_both_ways(tmp_path, mapping, roles, shapes):
    g = torch.Generator().manual_seed(0)
    tensors = {role: torch.randn(shape, generator=g) for role, shape in zip(roles, shapes)}
    sources = _hf_file(tmp_path, tensors)
    ctx = ShardContext(SHAPES)
    expected = mapping.hf_to_megatron(tensors, ctx)
    extents = trace_rows({r: _layout(s) for r, s in sources.items()},
                         lambda tracers: {"m": mapping.hf_to_megatron(tracers, ctx)},
                         {"m": tuple(expected.shape)}, torch.float32)["m"]
    got = _copied(extents, expected.nbytes, tmp_path)
    assert got == expected.numpy().tobytes()

    # Back: the Megatron tensor in a file, HF tensors traced out of it.
    (tmp_path / "m").mkdir()
    megatron = _hf_file(tmp_path / "m", {"m": expected})
    back = mapping.megatron_to_hf([expected], ctx)
    extents = trace_rows({"m": _layout(megatron["m"])},
                         lambda tracers: mapping.megatron_to_hf([tracers["m"][:]], ctx),
                         {role: tuple(t.shape) for role, t in back.items()}, torch.float32)
    for role, tensor in back.items():
        assert _copied(extents[role], tensor.nbytes, tmp_path) == tensor.numpy().tobytes(), role


def test_what_is_not_whole_rows_of_the_same_dtype_is_refused(tmp_path):
    g = torch.Generator().manual_seed(0)
    sources = _hf_file(tmp_path, {"w": torch.randn(6, 4, generator=g)})
    layouts = {"weight": _layout(sources["w"])}
    row_parallel = RowParallelMapping("proj", "w")
    with pytest.raises(NotRows):  # TP=2 rank 1: half of every row
        trace_rows(layouts,
                   lambda t: {"m": row_parallel.hf_to_megatron(t, ShardContext(SHAPES, 2, 1))},
                   {"m": (6, 2)}, torch.float32)
    with pytest.raises(NotRows):  # a cast
        trace_rows(layouts, lambda t: {"m": row_parallel.hf_to_megatron(t, ShardContext(SHAPES))},
                   {"m": (6, 4)}, torch.bfloat16)
    with pytest.raises(NotRows):  # a transpose
        trace_rows(layouts, lambda t: {"m": t["weight"][:].t()}, {"m": (4, 6)}, torch.float32)


def test_kernel_copy_stream_writes_records_torch_reads_and_checks_every_placeholder(tmp_path):
    from checkpoint_tools.byte_copy import kernel_copy_filesystem

    g = torch.Generator().manual_seed(0)
    source = _hf_file(tmp_path, {"w": torch.randn(64, 32, generator=g)})["w"]
    registry = CopyRegistry(FileCopier())
    extents = trace_rows({"w": _layout(source)}, lambda t: {"m": t["w"][:]}, {"m": (64, 32)},
                         torch.float32)["m"]
    placeholder = registry.placeholder((64, 32), torch.float32, extents)
    with kernel_copy_filesystem(registry).create_stream(tmp_path / "x.distcp", "wb") as stream:
        stream.write(b"an earlier item")
        start = stream.tell()  # as DCP asks before each item: padded to place the record
        torch.save(placeholder, stream)
    registry.check_done()
    assert registry.copier.kernel_bytes == placeholder.nbytes
    content = (tmp_path / "x.distcp").read_bytes()
    item = torch.load(io.BytesIO(content[start:]), weights_only=True)
    assert torch.equal(item, source[:])
    data_at = content.find(source[:].numpy().tobytes())
    assert data_at > start and data_at % 4096 == source.data_start % 4096  # page-congruent

    registry.placeholder((4,), torch.float32, [Extent(0, 16, None, 0)])
    with pytest.raises(CheckpointError, match="not copied"):
        registry.check_done()  # written by nobody: would be garbage in the file


def test_safetensors_header_padding_places_the_hinted_tensor_page_congruent(tmp_path):
    from safetensors.torch import load_file

    from checkpoint_tools.safetensors_writer import PlannedSafetensorsWriter, PlannedTensor
    from rlhf_megatron.models.hf_checkpoint import read_safetensors_layout

    g = torch.Generator().manual_seed(0)
    tensors = {"small": torch.randn(3, generator=g), "big": torch.randn(40, 8, generator=g)}
    plan = [[PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]]
    # big's copy: from byte 32 of the tensor, source offset 1004 mod 4096 (8-byte compatible)
    writer = PlannedSafetensorsWriter(tmp_path, plan, {"big": (32, 4096 * 7 + 1004)})
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    path = tmp_path / writer.file_name(0)
    big_start = read_safetensors_layout(path)["big"][2]
    assert (big_start + 32) % 4096 == 1004 and big_start % 4 == 0
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_rows_of_a_chunk_split_along_a_middle_dim():
    """Stacked experts (E, 2*ffn, hidden) stored as gate / up chunks split along dim 1: each
    expert's rows of a chunk are one run; rows are numbered in the whole tensor's order."""
    from checkpoint_tools.dcp_reader import _chunk_runs

    up = _chunk_runs((3, 4, 5), (0, 2, 0), (3, 2, 5), 4, Path("f"), 1000)
    assert [(r.start, r.stop, r.offset) for r in up] == [(2, 4, 1000), (6, 8, 1040),
                                                          (10, 12, 1080)]
    assert [(r.start, r.stop) for r in _chunk_runs((6, 5), (2, 0), (3, 5), 4, Path("f"), 0)] == [
        (2, 5)]
