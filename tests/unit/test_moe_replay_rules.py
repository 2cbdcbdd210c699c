"""MoE routing replay rules that need no model: the on-policy shortcut is off with replay (the
old-log-prob forward records the experts), the token-order maps between micro-batch rows and the
MoE layers' tokens, the top-k set comparison, and the aux-loss coefficient's check."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from rlhf_megatron.config import TrainConfig
from rlhf_megatron.controller.phases import on_policy_shortcut
from rlhf_megatron.engines import EngineConfig
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.moe_replay import moe_ordinals, rows_to_tokens, tokens_to_rows
from rlhf_megatron.models.moe_vllm_repack import reloaded_expert_layers


def test_routing_replay_turns_the_on_policy_shortcut_off():
    cfg = TrainConfig()
    assert on_policy_shortcut(cfg)
    actor = dataclasses.replace(cfg.actor, engine=EngineConfig(routing_replay=True))
    assert not on_policy_shortcut(dataclasses.replace(cfg, actor=actor))


def _micro(mask, packed):
    return SimpleNamespace(packed=object() if packed else None,
                           rows=SimpleNamespace(input_ids=torch.zeros(mask.shape),
                                                attention_mask=mask))


def test_rows_and_tokens_round_trip_in_megatron_token_order():
    values = torch.arange(2 * 3 * 2).view(2, 3, 2)  # (b, w, k)
    dense = _micro(torch.ones(2, 3), packed=False)
    tokens = rows_to_tokens(values, dense)  # [s, b] flattened: row 0 pos 0, row 1 pos 0, ...
    assert tokens[:2].tolist() == [[0, 1], [6, 7]]
    assert torch.equal(tokens_to_rows(tokens, dense), values)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    packed = _micro(mask, packed=True)  # real tokens, row after row (pack_rows)
    tokens = rows_to_tokens(values, packed)
    assert tokens.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    back = tokens_to_rows(tokens, packed)
    assert back[1, 2].tolist() == [-1, -1] and torch.equal(back[0], values[0])


def test_moe_ordinals_skip_dense_layers():
    assert moe_ordinals(SimpleNamespace(moe_layer_freq=[1, 0, 1, 1], num_layers=4)) == \
        {0: 0, 2: 1, 3: 2}
    assert moe_ordinals(SimpleNamespace(moe_layer_freq=2, num_layers=4)) == {0: 0, 2: 1}


def test_reloaded_expert_layers_from_hf_names():
    names = ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.gate.weight",
             "model.layers.1.block_sparse_moe.experts.0.w1.weight", "lm_head.weight"]
    assert reloaded_expert_layers(names) == ["model.layers.0.mlp.experts",
                                             "model.layers.1.block_sparse_moe.experts"]


def test_negative_aux_loss_coefficient_is_refused():
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff=-0.1 must be >= 0"):
        EngineConfig(moe_aux_loss_coeff=-0.1).validate()
