"""Per-architecture mapping tables: every Megatron name (local and TE spec) resolves, every HF
tensor is exported exactly once, and the whole state dict round-trips at fake TP 1, 2, 4, 8."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.models import ARCHITECTURES
from rlhf_megatron.models.param_mapping import ModelShapes, ShardContext
from rlhf_megatron.testing.tiny_models import TINY_ARCHITECTURES, tiny_hf_config

LAYERS = 2
CASES = [(arch, tied) for arch in TINY_ARCHITECTURES for tied in (False, True)]
IDS = [f"{arch}-tied{tied}" for arch, tied in CASES]


def _megatron_names(spec, cfg, *, te: bool) -> list[str]:
    per_layer = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    if te:
        per_layer += ["self_attention.linear_qkv.layer_norm_weight",
                      "mlp.linear_fc1.layer_norm_weight"]
    else:
        per_layer += ["input_layernorm.weight", "pre_mlp_layernorm.weight"]
    if spec.qkv_bias(cfg):
        per_layer.append("self_attention.linear_qkv.bias")
    if spec.qk_norm(cfg):
        per_layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    names += [f"decoder.layers.{i}.{n}" for i in range(LAYERS) for n in per_layer]
    if not cfg.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def _config_and_state(arch: str, tied: bool):
    import transformers

    # 8 query heads in 8 groups so that TP 8 divides everything.
    cfg = tiny_hf_config(arch, vocab_size=301, tie_word_embeddings=tied, num_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return cfg, state


@pytest.mark.parametrize("arch,tied", CASES, ids=IDS)
def test_table_covers_megatron_and_hf_names_once(arch, tied):
    cfg, state = _config_and_state(arch, tied)
    spec = ARCHITECTURES.for_hf_config(cfg)
    table = spec.mapping_table_for(cfg)
    for te in (False, True):
        exported: list[str] = []
        for name in _megatron_names(spec, cfg, te=te):
            resolved = table.resolve(name)
            assert resolved is not None, name
            assert resolved.mapping.export
            exported += resolved.hf_names.values()
        assert sorted(exported) == sorted(state), f"te={te}"
    assert table.resolve("module.module.decoder.final_layernorm.weight") is not None
    assert table.resolve("decoder.layers.0.unknown.weight") is None
    tied_output = table.resolve("output_layer.weight")
    assert (tied_output.hf_names["weight"] == "model.embed_tokens.weight") == tied
    assert tied_output.mapping.export != tied


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("arch,tied", CASES, ids=IDS)
def test_state_dict_round_trips_through_tp_shards(arch, tied, tp):
    from rlhf_megatron.models import pad_vocab_size

    cfg, state = _config_and_state(arch, tied)
    spec = ARCHITECTURES.for_hf_config(cfg)
    table = spec.mapping_table_for(cfg)
    shapes = ModelShapes(8, 8, 16, 301, padded_vocab_size=pad_vocab_size(301, tp))
    back: dict[str, torch.Tensor] = {}
    for name in _megatron_names(spec, cfg, te=False):
        resolved = table.resolve(name)
        shards = [resolved.hf_to_megatron(state.__getitem__, ShardContext(shapes, tp, r))
                  for r in range(tp)]
        for hf_name, tensor in resolved.megatron_to_hf(shards, ShardContext(shapes, tp)):
            assert hf_name not in back
            back[hf_name] = tensor
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
