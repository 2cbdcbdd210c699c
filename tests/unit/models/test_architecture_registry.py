"""Architecture registry (exact `architectures` names) and the HF -> Megatron config translation."""

import pytest
import torch

from rlhf_megatron.errors import ConfigError, UnsupportedArchitectureError
from rlhf_megatron.models import ARCHITECTURES, hf_to_megatron_args, pad_vocab_size
from rlhf_megatron.parallel import ParallelDims
from rlhf_megatron.platform import Platform
from rlhf_megatron.testing.tiny_models import (
    TINY_ARCHITECTURES,
    TINY_MOE_ARCHITECTURES,
    tiny_hf_config,
)

CPU = Platform("cpu", "gloo")


def _translate(cfg, dims=None, **kwargs):
    spec = ARCHITECTURES.for_hf_config(cfg)
    return hf_to_megatron_args(cfg, spec, dims or ParallelDims(1), platform=CPU, **kwargs)


def test_supported_architectures_are_registered():
    assert ARCHITECTURES.names() == sorted(TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES)


@pytest.mark.parametrize(
    "name", ["GPT2LMHeadModel", "LlamaForCausalLMX", "llamaforcausallm", "MyLlamaForCausalLM"]
)
def test_unknown_or_substring_names_are_rejected_with_the_supported_list(name):
    cfg = tiny_hf_config("LlamaForCausalLM", vocab_size=300, architectures=[name])
    with pytest.raises(UnsupportedArchitectureError) as info:
        ARCHITECTURES.for_hf_config(cfg)
    message = str(info.value)
    assert f"unsupported architecture {name!r}" in message
    for supported in TINY_ARCHITECTURES:
        assert supported in message


def test_missing_architectures_field_is_an_error():
    cfg = tiny_hf_config("LlamaForCausalLM", vocab_size=300, architectures=None)
    with pytest.raises(UnsupportedArchitectureError, match="exactly one architecture"):
        ARCHITECTURES.for_hf_config(cfg)


@pytest.mark.parametrize(
    "arch,qkv_bias,qk_norm",
    [
        ("LlamaForCausalLM", False, False),
        ("MistralForCausalLM", False, False),
        ("Qwen2ForCausalLM", True, False),
        ("Qwen3ForCausalLM", False, True),
    ],
)
def test_translation_per_architecture(arch, qkv_bias, qk_norm):
    cfg = tiny_hf_config(arch, vocab_size=300)
    args = _translate(cfg)
    tc = args.transformer_config
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (4, 128, 256)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (4, 2, 32)
    assert tc.add_qkv_bias is qkv_bias and tc.qk_layernorm is qk_norm
    assert tc.normalization == "RMSNorm" and tc.gated_linear_unit and not tc.add_bias_linear
    assert tc.layernorm_epsilon == cfg.rms_norm_eps
    assert tc.use_cpu_initialization and not args.use_te_spec
    assert args.rotary_base == 10000.0 and args.rope_scaling_factor is None


def test_vocab_padding_follows_megatron_rule():
    assert pad_vocab_size(300, 1) == 384
    assert pad_vocab_size(300, 2) == 512
    assert pad_vocab_size(256, 2) == 256
    assert pad_vocab_size(152064, 8) == 152576  # Qwen2.5 at TP=8: 149 * 1024
    assert pad_vocab_size(151552, 8) == 151552
    assert _translate(tiny_hf_config("LlamaForCausalLM", vocab_size=300)).padded_vocab_size == 384


def test_tied_embeddings_and_dtype_are_carried():
    cfg = tiny_hf_config("LlamaForCausalLM", vocab_size=300, tie_word_embeddings=True)
    args = _translate(cfg, params_dtype=torch.bfloat16)
    assert args.tie_word_embeddings
    assert args.transformer_config.bf16 and args.transformer_config.params_dtype == torch.bfloat16


def test_llama3_rope_scaling_is_translated():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    cfg = tiny_hf_config("LlamaForCausalLM", vocab_size=300, rope_parameters=rope,
                         max_position_embeddings=131072)
    args = _translate(cfg, max_sequence_length=256)
    assert args.rope_scaling_factor == 8.0 and args.rotary_base == 500000.0


def test_unsupported_rope_scaling_is_refused():
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
            "original_max_position_embeddings": 64}
    cfg = tiny_hf_config("Qwen2ForCausalLM", vocab_size=300, rope_parameters=rope)
    with pytest.raises(ConfigError, match="rope scaling .* is unsupported"):
        _translate(cfg)


def test_sliding_window_shorter_than_sequence_is_refused():
    cfg = tiny_hf_config("MistralForCausalLM", vocab_size=300, sliding_window=64)
    with pytest.raises(ConfigError, match="sliding_window=64 < max_sequence_length=256"):
        _translate(cfg)
    assert _translate(cfg, max_sequence_length=64).max_sequence_length == 64


def test_layout_checks_run_during_translation():
    cfg = tiny_hf_config("LlamaForCausalLM", vocab_size=300)
    with pytest.raises(ConfigError, match="num_key_value_heads=2 is not divisible by tp=4"):
        _translate(cfg, ParallelDims(4, tp=4))
    with pytest.raises(ConfigError, match="num_layers=4 is not divisible by pp\\*vpp = 2\\*4"):
        _translate(cfg, ParallelDims(2, pp=2, vpp=4))


@pytest.mark.parametrize(
    "arch,overrides,message",
    [
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu' is unsupported"),
        ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias=True is unsupported"),
        ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias=True is unsupported"),
        ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias=True is unsupported"),
    ],
)
def test_config_values_megatron_cannot_express_are_refused(arch, overrides, message):
    cfg = tiny_hf_config(arch, vocab_size=300, **overrides)
    with pytest.raises(ConfigError, match=message):
        ARCHITECTURES.for_hf_config(cfg)
