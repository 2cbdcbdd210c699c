"""Typed mappings: round trips HF -> TP shards -> HF at fake TP 1, 2, 4, 8 (no torch.distributed),
and each shard checked against an independent statement of Megatron's layout."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.models.megatron_layout import (
    interleave_qkv,
    resize_vocab_rows,
    split_qkv,
    tp_chunk,
    tp_chunk_gated,
    vocab_range,
)
from rlhf_megatron.models.param_mapping import (
    ColumnParallelMapping,
    DirectMapping,
    GatedMLPMapping,
    ModelShapes,
    QKVMapping,
    RowParallelMapping,
    ShardContext,
    VocabParallelMapping,
)

TPS = [1, 2, 4, 8]
HEADS, GROUPS, HEAD_DIM, HIDDEN, FFN, VOCAB = 16, 8, 4, 24, 40, 301
SHAPES = ModelShapes(HEADS, GROUPS, HEAD_DIM, VOCAB, padded_vocab_size=8 * 40)  # 320 = 8 * 40


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _round_trip(mapping, hf: dict[str, torch.Tensor], tp: int) -> list[torch.Tensor]:
    shards = [mapping.hf_to_megatron(hf, ShardContext(SHAPES, tp, r)) for r in range(tp)]
    back = mapping.megatron_to_hf(shards, ShardContext(SHAPES, tp, 0))
    assert back.keys() == hf.keys()
    for role, tensor in hf.items():
        assert torch.equal(back[role], tensor), role
    return shards


def _megatron_fused_qkv(q, k, v) -> torch.Tensor:
    """Megatron's TP=1 layout written out head by head, independently of interleave_qkv."""
    rows, hpg = [], HEADS // GROUPS
    for g in range(GROUPS):
        for h in range(g * hpg, (g + 1) * hpg):
            rows.append(q[h * HEAD_DIM : (h + 1) * HEAD_DIM])
        rows.append(k[g * HEAD_DIM : (g + 1) * HEAD_DIM])
        rows.append(v[g * HEAD_DIM : (g + 1) * HEAD_DIM])
    return torch.cat(rows)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
def test_qkv_gqa_round_trip_and_megatron_layout(tp, bias):
    rest = () if bias else (HIDDEN,)
    hf = {"q": _rand(HEADS * HEAD_DIM, *rest, seed=1), "k": _rand(GROUPS * HEAD_DIM, *rest, seed=2),
          "v": _rand(GROUPS * HEAD_DIM, *rest, seed=3)}
    shards = _round_trip(QKVMapping("qkv", q="q", k="k", v="v"), hf, tp)
    full = _megatron_fused_qkv(hf["q"], hf["k"], hf["v"])
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, tp_chunk(full, tp=tp, rank=rank, dim=0))


def test_qkv_multi_query_attention_one_group():
    q, k, v = _rand(8 * 4, 6), _rand(4, 6, seed=1), _rand(4, 6, seed=2)
    fused = interleave_qkv(q, k, v, num_query_groups=1)
    assert torch.equal(fused, torch.cat([q, k, v]))
    back = split_qkv(fused, num_query_groups=1, heads_per_group=8, head_dim=4)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


@pytest.mark.parametrize("tp", TPS)
def test_gated_mlp_round_trip_holds_gate_then_up_per_rank(tp):
    hf = {"gate": _rand(FFN, HIDDEN, seed=4), "up": _rand(FFN, HIDDEN, seed=5)}
    shards = _round_trip(GatedMLPMapping("fc1", gate="gate", up="up"), hf, tp)
    full = torch.cat([hf["gate"], hf["up"]])
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, tp_chunk_gated(full, tp=tp, rank=rank))
        gate_r, up_r = shard.chunk(2)
        assert torch.equal(gate_r, hf["gate"].chunk(tp)[rank])
        assert torch.equal(up_r, hf["up"].chunk(tp)[rank])


@pytest.mark.parametrize("tp", TPS)
def test_column_row_and_direct_round_trip(tp):
    weight = _rand(FFN, HIDDEN, seed=6)
    columns = _round_trip(ColumnParallelMapping("m", "h"), {"weight": weight}, tp)
    rows = _round_trip(RowParallelMapping("m", "h"), {"weight": weight}, tp)
    for rank in range(tp):
        assert columns[rank].shape == (FFN // tp, HIDDEN)
        assert torch.equal(rows[rank], weight[:, rank * HIDDEN // tp : (rank + 1) * HIDDEN // tp])
    norm = _rand(HEAD_DIM, seed=7)
    for shard in _round_trip(DirectMapping("m", "h"), {"weight": norm}, tp):
        assert torch.equal(shard, norm)


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_pads_with_zero_rows_and_trims_on_export(tp):
    weight = _rand(VOCAB, HIDDEN, seed=8)
    shards = _round_trip(VocabParallelMapping("m", "h"), {"weight": weight}, tp)
    padded = resize_vocab_rows(weight, SHAPES.padded_vocab_size)
    for rank, shard in enumerate(shards):
        assert shard.shape == (SHAPES.padded_vocab_size // tp, HIDDEN)
        assert torch.equal(shard, tp_chunk(padded, tp=tp, rank=rank, dim=0))
    assert torch.count_nonzero(torch.cat(shards)[VOCAB:]) == 0


def test_vocab_range_of_ranks_holding_only_padding():
    # padded 320 over 8 ranks = 40 rows each; the real 301 rows end inside rank 7.
    assert vocab_range(320, 301, tp=8, rank=7) == (280, 301)
    assert vocab_range(320, 250, tp=8, rank=7) == (250, 250)


def test_mappings_read_through_lazy_safetensors_slices(tmp_path):
    from safetensors.torch import save_file

    from rlhf_megatron.models.hf_checkpoint import LazyTensor

    hf = {"q": _rand(HEADS * HEAD_DIM, HIDDEN, seed=1), "k": _rand(GROUPS * HEAD_DIM, HIDDEN, seed=2),
          "v": _rand(GROUPS * HEAD_DIM, HIDDEN, seed=3), "o": _rand(HIDDEN, HEADS * HEAD_DIM),
          "emb": _rand(VOCAB, HIDDEN)}
    save_file(hf, str(tmp_path / "w.safetensors"))
    cases = [(QKVMapping("x", q="q", k="k", v="v"), ("q", "k", "v")),
             (RowParallelMapping("x", "o"), ("o",)), (VocabParallelMapping("x", "emb"), ("emb",))]
    file = tmp_path / "w.safetensors"
    for mapping, names in cases:
        for rank in range(4):
            ctx = ShardContext(SHAPES, 4, rank)
            lazy = {role: LazyTensor.from_file(file, n) for role, n in zip(mapping.hf, names)}
            eager = {role: hf[n] for role, n in zip(mapping.hf, names)}
            assert torch.equal(mapping.hf_to_megatron(lazy, ctx), mapping.hf_to_megatron(eager, ctx))


def test_rank_holding_only_vocab_padding_reads_an_empty_lazy_slice(tmp_path):
    from safetensors.torch import save_file

    from rlhf_megatron.models.hf_checkpoint import LazyTensor

    save_file({"emb": _rand(100, HIDDEN)}, str(tmp_path / "e.safetensors"))
    lazy = LazyTensor.from_file(tmp_path / "e.safetensors", "emb")
    shapes = ModelShapes(HEADS, GROUPS, HEAD_DIM, vocab_size=100, padded_vocab_size=256)
    mapping = VocabParallelMapping("m", "emb")
    shards = [mapping.hf_to_megatron({"weight": lazy}, ShardContext(shapes, 2, r)) for r in range(2)]
    assert shards[1].shape == (128, HIDDEN) and torch.count_nonzero(shards[1]) == 0
    assert torch.equal(mapping.megatron_to_hf(shards, ShardContext(shapes, 2))["weight"], lazy[:])
