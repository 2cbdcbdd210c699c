"""Locating a LoRA checkpoint's adapters (checkpoint_tools/lora_adapters.py): each stored part
maps to the HF projection the architecture's table names, and the PEFT target regex matches
exactly the adapted modules (not MoE experts' projections of the same leaf name)."""

from __future__ import annotations

import re

import pytest
import torch

from checkpoint_tools.lora_adapters import (
    find_adapters,
    lora_scale,
    merged_weight,
    target_modules_regex,
)
from checkpoint_tools.mcore_to_hf import SourceTensor
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.mapping_tables import llama_like_table

TABLE = llama_like_table(qkv_bias=False, qk_norm=False, tied=False)
RANK = 4


def _source(name: str, shape: tuple[int, ...]) -> SourceTensor:
    return SourceTensor(name, name, torch.Size(shape), torch.float32, None)


def _sources(layers: int = 2, drop: str | None = None) -> list[SourceTensor]:
    parts = {"self_attention.linear_qkv": ("q", "k", "v"), "self_attention.linear_proj": ("proj",),
             "mlp.linear_fc1": ("gate", "up"), "mlp.linear_fc2": ("fc2",)}
    out = [_source("decoder.layers.0.self_attention.linear_qkv.weight", (96, 32))]
    for layer in range(layers):
        for linear, names in parts.items():
            for part in names:
                for matrix, shape in (("a", (RANK, 32)), ("b", (16, RANK))):
                    name = f"decoder.layers.{layer}.{linear}.lora.{matrix}.{part}"
                    if name != drop:
                        out.append(_source(name, shape))
    return out


def test_each_part_maps_to_its_hf_projection():
    adapters = find_adapters(_sources(), TABLE)
    assert len(adapters) == 2 * 7
    q = adapters["model.layers.1.self_attn.q_proj.weight"]
    assert q.a.megatron_name == "decoder.layers.1.self_attention.linear_qkv.lora.a.q"
    assert q.b.megatron_name == "decoder.layers.1.self_attention.linear_qkv.lora.b.q"
    assert adapters["model.layers.0.mlp.up_proj.weight"].b.megatron_name.endswith("fc1.lora.b.up")
    assert adapters["model.layers.0.self_attn.o_proj.weight"].a.megatron_name.endswith(
        "linear_proj.lora.a.proj")
    assert adapters["model.layers.0.mlp.down_proj.weight"].hf_module == "model.layers.0.mlp.down_proj"
    assert find_adapters(_sources()[:1], TABLE) == {}


def test_a_missing_matrix_or_a_wrong_rank_is_one_error():
    with pytest.raises(CheckpointError, match=r"adapter 'v' of decoder\.layers\.1\.self_attention"
                                              r"\.linear_qkv\.weight has no lora\.b tensor"):
        find_adapters(_sources(drop="decoder.layers.1.self_attention.linear_qkv.lora.b.v"), TABLE)
    adapters = find_adapters(_sources(), TABLE)
    assert lora_scale({"rank": RANK, "alpha": 8}, adapters) == 2.0
    with pytest.raises(CheckpointError, match="has rank 4, the metadata says 8"):
        lora_scale({"rank": 8, "alpha": 8}, adapters)


def test_the_peft_regex_matches_the_adapted_modules_only():
    pattern = target_modules_regex(find_adapters(_sources(), TABLE))
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.17.mlp.gate_proj",
                 "model.layers.3.mlp.down_proj"):
        assert re.fullmatch(pattern, name), name
    for name in ("model.layers.0.mlp.experts.3.gate_proj", "model.layers.0.self_attn.q_proj.x",
                 "model.layers.0.mlp.shared_experts.up_proj", "lm_head"):
        assert not re.fullmatch(pattern, name), name


def test_merging_adds_the_scaled_product_in_fp32_and_casts_once():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=g).to(torch.bfloat16)
    a, b = torch.randn(2, 6, generator=g), torch.randn(8, 2, generator=g)
    merged = merged_weight(w, a, b, 0.5, torch.bfloat16)
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, (w.float() + 0.5 * (b @ a)).to(torch.bfloat16))
