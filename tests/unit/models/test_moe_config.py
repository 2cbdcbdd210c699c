"""MoE config translation, refusals, expert mappings and expert-index globalisation (no ranks)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_megatron.errors import ConfigError, LayoutError
from rlhf_megatron.models import ARCHITECTURES, hf_to_megatron_args
from rlhf_megatron.models.megatron_layout import global_layer_name
from rlhf_megatron.models.moe_config import moe_shape
from rlhf_megatron.models.param_mapping import ModelShapes, ShardContext
from rlhf_megatron.parallel import ParallelDims
from rlhf_megatron.platform import Platform
from rlhf_megatron.testing.tiny_models import TINY_MOE_ARCHITECTURES, tiny_hf_config

CPU = Platform("cpu", "gloo")


def _args(cfg, dims=None):
    return hf_to_megatron_args(cfg, ARCHITECTURES.for_hf_config(cfg), dims or ParallelDims(1),
                               platform=CPU)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_translation(norm_topk_prob):
    cfg = tiny_hf_config("Qwen3MoeForCausalLM", vocab_size=300, num_layers=6,
                         decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=norm_topk_prob,
                         router_aux_loss_coef=0.002)
    config = _args(cfg).transformer_config
    assert config.num_moe_experts == 4 and config.moe_router_topk == 2
    assert config.moe_ffn_hidden_size == 64 and config.ffn_hidden_size == 256
    # Layer i is sparse iff (i + 1) % step == 0 and i not in mlp_only_layers (HF's rule).
    assert config.moe_layer_freq == [0, 1, 0, 0, 0, 1]
    assert config.moe_router_pre_softmax is (not norm_topk_prob)
    assert config.moe_aux_loss_coeff == 0.002 and config.moe_router_load_balancing_type == "aux_loss"
    assert config.moe_router_dtype == "fp32" and config.moe_token_dispatcher_type == "alltoall"


def test_mixtral_translation_and_refusals():
    cfg = tiny_hf_config("MixtralForCausalLM", vocab_size=300)
    config = _args(cfg).transformer_config
    assert config.moe_layer_freq == [1, 1, 1, 1] and config.moe_router_pre_softmax is False
    assert config.moe_ffn_hidden_size == 64
    jitter = tiny_hf_config("MixtralForCausalLM", vocab_size=300, router_jitter_noise=0.1)
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        ARCHITECTURES.for_hf_config(jitter)
    with pytest.raises(LayoutError, match="num_experts=4 is not divisible by ep=3"):
        _args(cfg, ParallelDims(3, ep=3))
    dense = tiny_hf_config("LlamaForCausalLM", vocab_size=300)
    with pytest.raises(ConfigError, match="ep=2 needs an MoE architecture"):
        _args(dense, ParallelDims(2, ep=2))
    no_sparse = tiny_hf_config("Qwen3MoeForCausalLM", vocab_size=300, mlp_only_layers=[0, 1, 2, 3])
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        moe_shape(no_sparse)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_router_equals_hf_router(norm_topk_prob):
    """HF: softmax over all experts, top-k, renormalise if norm_topk_prob. Megatron with
    pre_softmax = not norm_topk_prob gives the same probabilities on the same experts."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, dim=-1)
    top, index = probs.topk(2, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    expected = torch.zeros_like(probs).scatter(1, index, top)
    got, routing_map = topk_routing_with_score_function(
        logits, 2, use_pre_softmax=not norm_topk_prob, score_function="softmax")
    assert torch.equal(routing_map, expected > 0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", [a for a in TINY_MOE_ARCHITECTURES if a != "GptOssForCausalLM"])
@pytest.mark.parametrize("tp", [1, 2])
def test_expert_mappings_round_trip_sequential_and_grouped(arch, tp):
    # One MoE layer of 4 experts for every family (GLM-4.5's tiny model has 8, after a dense one).
    glm = ({"first_k_dense_replace": 0, "n_routed_experts": 4}
           if arch.startswith(("Glm4", "DeepseekV3")) else {})
    cfg = tiny_hf_config(arch, vocab_size=300, num_layers=1, **glm)
    table = ARCHITECTURES.for_hf_config(cfg).mapping_table_for(cfg)
    block, gate, up, down = (("block_sparse_moe", "w1", "w3", "w2") if arch.startswith("Mixtral")
                             else ("mlp", "gate_proj", "up_proj", "down_proj"))
    g = torch.Generator().manual_seed(1)
    hf = {f"model.layers.0.{block}.experts.{e}.{n}.weight": torch.randn(s, generator=g)
          for e in range(4) for n, s in ((gate, (64, 128)), (up, (64, 128)), (down, (128, 64)))}
    hf[f"model.layers.0.{block}.gate.weight"] = torch.randn(4, 128, generator=g)
    shapes = ModelShapes(4, 2, 32, 300, 384)
    for names in (
        [f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{i}.weight"
         for e in range(4) for i in (1, 2)],
        [f"decoder.layers.0.mlp.experts.linear_fc{i}.weight{e}" for e in range(4) for i in (1, 2)],
    ):
        back = {}
        for name in [*names, "decoder.layers.0.mlp.router.weight"]:
            resolved = table.resolve(name)
            shards = [resolved.hf_to_megatron(hf.__getitem__, ShardContext(shapes, tp, r))
                      for r in range(tp)]
            back.update(resolved.megatron_to_hf(shards, ShardContext(shapes, tp, 0)))
        assert back.keys() == hf.keys()
        assert all(torch.equal(back[k], hf[k]) for k in hf)
    fc1 = table.resolve("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")
    shard = fc1.hf_to_megatron(hf.__getitem__, ShardContext(shapes, 1, 0))
    expert3 = f"model.layers.0.{block}.experts.3."
    assert torch.equal(shard, torch.cat([hf[f"{expert3}{gate}.weight"], hf[f"{expert3}{up}.weight"]]))


def test_glm4_moe_translation():
    """GLM-4.5's router and layer pattern (models/moe_config.py, the sigmoid router)."""
    cfg = tiny_hf_config("Glm4MoeForCausalLM", vocab_size=300)
    args = _args(cfg)
    config = args.transformer_config
    assert config.num_moe_experts == 8 and config.moe_router_topk == 2
    assert config.moe_layer_freq == [0, 1, 1, 1]  # first_k_dense_replace=1
    assert config.moe_router_score_function == "sigmoid" and not config.moe_router_pre_softmax
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.0
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.moe_router_topk_scaling_factor == 2.5
    assert config.moe_shared_expert_intermediate_size == 64 and not config.moe_shared_expert_gate
    assert config.moe_router_load_balancing_type == "none"
    assert config.add_qkv_bias and config.qk_layernorm and args.rotary_percent == 0.5
    plain = _args(tiny_hf_config("Glm4MoeForCausalLM", vocab_size=300, n_group=1,
                                 use_qk_norm=False, attention_bias=False)).transformer_config
    assert plain.moe_router_num_groups is None and not plain.qk_layernorm
    assert not plain.add_qkv_bias


@pytest.mark.parametrize("field,value,match", [
    ("norm_topk_prob", False, "norm_topk_prob=False"),
    ("topk_group", 2, "topk_group=2"),  # top-2 of 2 groups: a group scored by its top 1
    ("first_k_dense_replace", 4, "first_k_dense_replace=4"),
    ("n_group", 3, "not divisible by n_group=3"),
])
def test_glm4_moe_refusals(field, value, match):
    cfg = tiny_hf_config("Glm4MoeForCausalLM", vocab_size=300, **{field: value})
    with pytest.raises(ConfigError, match=match):
        ARCHITECTURES.for_hf_config(cfg)


def test_deepseek_v3_translation():
    """Multi-latent attention fields and YaRN (models/config_translation.py `_mla_kwargs`)."""
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "rope_theta": 10000.0}
    cfg = tiny_hf_config("DeepseekV3ForCausalLM", vocab_size=300, rope_parameters=yarn)
    config = _args(cfg).transformer_config
    assert config.multi_latent_attention and config.qk_layernorm
    assert (config.q_lora_rank, config.kv_lora_rank) == (64, 32)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (32, 16, 32)
    assert config.rope_type == "yarn" and config.rotary_scaling_factor == 40.0
    assert config.original_max_position_embeddings == 4096 and config.mscale_all_dim == 1.0
    assert config.moe_router_score_function == "sigmoid" and config.moe_layer_freq == [0, 1, 1, 1]
    plain = _args(tiny_hf_config("DeepseekV3ForCausalLM", vocab_size=300)).transformer_config
    assert plain.rope_type == "rope" and plain.rotary_base == 10000.0


@pytest.mark.parametrize("field,value,match", [
    ("rope_interleave", False, "rope_interleave=False"),
    ("attention_bias", True, "attention_bias=True"),
    ("scoring_func", "softmax", "scoring_func='softmax'"),
    ("topk_method", "greedy", "topk_method='greedy'"),
    ("rms_norm_eps", 1e-5, "rms_norm_eps=1e-05"),
])
def test_deepseek_v3_refusals(field, value, match):
    cfg = tiny_hf_config("DeepseekV3ForCausalLM", vocab_size=300, **{field: value})
    with pytest.raises(ConfigError, match=match):
        _args(cfg)


def test_partial_rotary_must_rotate_an_even_number_of_dimensions():
    cfg = tiny_hf_config("Glm4MoeForCausalLM", vocab_size=300)
    cfg.rope_parameters["partial_rotary_factor"] = 0.3  # 9.6 of 32 dimensions
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.3"):
        _args(cfg)


@pytest.mark.parametrize("groups,group_topk,topk", [(1, 1, 2), (2, 1, 2), (4, 2, 4)])
def test_megatron_sigmoid_router_equals_hf_glm4_router(groups, group_topk, topk):
    """HF's own Glm4MoeTopkRouter (sigmoid, bias for the choice only, group-limited top-k,
    renormalised, scaled) against Megatron's routing with the translated settings."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = tiny_hf_config("Glm4MoeForCausalLM", vocab_size=300, n_group=groups,
                         topk_group=group_topk, num_experts_per_tok=topk)
    shape = moe_shape(cfg)
    g = torch.Generator().manual_seed(groups)
    router = Glm4MoeTopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=g))
    hidden = torch.randn(64, 128, generator=g)
    logits, weights, index = router(hidden)
    expected = torch.zeros_like(logits).scatter(1, index, weights)
    got, routing_map = topk_routing_with_score_function(
        logits, topk, score_function="sigmoid", expert_bias=router.e_score_correction_bias,
        num_groups=shape.num_groups or None, group_topk=shape.group_topk or None,
        scaling_factor=shape.scaling_factor)
    assert torch.equal(routing_map, expected > 0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_local_expert_names_become_global():
    assert (global_layer_name("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", 2, 6)
            == "decoder.layers.3.mlp.experts.local_experts.6.linear_fc1.weight")
    assert (global_layer_name("decoder.layers.0.mlp.experts.linear_fc2.weight1", 0, 2)
            == "decoder.layers.0.mlp.experts.linear_fc2.weight3")
    assert (global_layer_name("decoder.layers.0.mlp.router.weight", 0, 2)
            == "decoder.layers.0.mlp.router.weight")


def test_expert_load_metrics_and_routing_mismatch():
    from rlhf_megatron.models.moe_layers import expert_load_metrics, routing_mismatch_fraction

    metrics = expert_load_metrics({3: torch.tensor([2, 6, 4, 4])})
    assert metrics == {"moe/load_max/layer3": 1.5, "moe/load_min/layer3": 0.5}
    a = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3]])
    b = torch.tensor([[1, 0], [2, 3], [1, 3], [0, 3]])  # same sets except row 2
    assert routing_mismatch_fraction(a, b) == 0.25
    assert routing_mismatch_fraction(a, a) == 0.0


def test_gpt_oss_translation():
    """gpt-oss (models/gpt_oss.py): biases everywhere, the clamped SwiGLU with its +1, sinks,
    a sliding window on layers 0 and 2, the softmax-of-top-k router, YaRN's softmax scale."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    cfg = tiny_hf_config("GptOssForCausalLM", vocab_size=300)
    args = _args(cfg)
    config = args.transformer_config
    assert config.num_moe_experts == 4 and config.moe_router_topk == 2
    assert config.moe_layer_freq == [1, 1, 1, 1] and config.moe_ffn_hidden_size == 64
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
    assert config.add_bias_linear and config.gated_linear_unit
    assert config.activation_func is quick_gelu and config.glu_linear_offset == 1.0
    assert config.activation_func_clamp_value == 0.5 and config.softmax_type == "learnable"
    assert config.window_size == (3, 0) and config.window_attn_skip_freq == [1, 0, 1, 0]
    assert config.softmax_scale is None and args.rope_scaling is None and not args.use_te_spec
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0}
    args = _args(tiny_hf_config("GptOssForCausalLM", vocab_size=300, rope_parameters=yarn))
    factor = 0.1 * math.log(32.0) + 1.0  # HF multiplies cos and sin by it: q.k by its square
    assert args.transformer_config.softmax_scale == pytest.approx(factor ** 2 / math.sqrt(32))
    assert not args.rope_scaling.truncate and args.rope_scaling.factor == 32.0


def test_gpt_oss_yarn_frequencies_equal_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate in (False, True):
        yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate, "rope_theta": 150000.0}
        cfg = tiny_hf_config("GptOssForCausalLM", vocab_size=300, rope_parameters=yarn)
        hf_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        scaling = _args(cfg).rope_scaling
        plain = 1.0 / (150000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
        assert torch.allclose(scaling.scale(plain), hf_freq, rtol=1e-6, atol=0)
        assert scaling.attention_factor == pytest.approx(hf_factor)


@pytest.mark.parametrize("field,value,match", [
    ("swiglu_alpha", 1.5, "swiglu_alpha=1.5"),
    ("attention_bias", False, "attention_bias=False"),
    ("layer_types", ["sliding_attention", "chunked_attention"] * 2, "layer_types="),
    ("quantization_config", {"quant_method": "mxfp4"}, "quantization_config"),
])
def test_gpt_oss_refusals(field, value, match):
    cfg = tiny_hf_config("GptOssForCausalLM", vocab_size=300)
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=match):
        ARCHITECTURES.for_hf_config(cfg)


def test_gpt_oss_is_refused_at_tp2():
    # Megatron-Core 0.16 asserts that MoE biases run at expert-TP 1 only.
    cfg = tiny_hf_config("GptOssForCausalLM", vocab_size=300)
    with pytest.raises(LayoutError, match="tp=2 is unsupported for GptOssForCausalLM"):
        _args(cfg, ParallelDims(2, tp=2))


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_oss_fused_expert_mappings_round_trip(tp):
    """Per-expert (direct load, refit) and stacked (converter) mappings of the fused, interleaved
    HF experts; the refit names an expert's slice `...experts.<e>.<tensor>` (vLLM's streamed
    names)."""
    cfg = tiny_hf_config("GptOssForCausalLM", vocab_size=300, num_layers=1)
    table = ARCHITECTURES.for_hf_config(cfg).mapping_table_for(cfg)
    g = torch.Generator().manual_seed(1)
    prefix = "model.layers.0.mlp.experts."
    hf = {f"{prefix}gate_up_proj": torch.randn(4, 128, 128, generator=g),
          f"{prefix}gate_up_proj_bias": torch.randn(4, 128, generator=g),
          f"{prefix}down_proj": torch.randn(4, 64, 128, generator=g),
          f"{prefix}down_proj_bias": torch.randn(4, 128, generator=g)}
    shapes = ModelShapes(4, 2, 32, 300, 384)

    def round_trip(name):
        resolved = table.resolve(name)
        shards = [resolved.hf_to_megatron(hf.__getitem__, ShardContext(shapes, tp, r))
                  for r in range(tp)]
        return shards, dict(resolved.megatron_to_hf(shards, ShardContext(shapes, tp, 0)))

    for tensor in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"):
        _, back = round_trip(f"decoder.layers.0.mlp.experts.experts.{tensor}")
        assert all(torch.equal(back[k], hf[k]) for k in back) and len(back) == 1
        for e in range(4):
            _, back = round_trip(f"decoder.layers.0.mlp.experts.local_experts.{e}.{tensor}")
            ((name, value),) = back.items()
            leaf = name.rpartition(".")[2]
            assert name == f"{prefix}{e}.{leaf}" and torch.equal(value, hf[prefix + leaf][e])
    # Expert 3's fc1 on rank 0: its gate columns (0::2), then its up columns (1::2), transposed.
    shards, _ = round_trip("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")
    fused = hf[f"{prefix}gate_up_proj"][3]
    half = 64 // tp
    assert torch.equal(shards[0], torch.cat([fused[:, 0::2][:, :half], fused[:, 1::2][:, :half]],
                                            dim=1).t())
