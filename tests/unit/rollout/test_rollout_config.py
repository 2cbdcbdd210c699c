"""Rollout config errors are caught at start-up, before vLLM is even imported."""

import pytest

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.rollout import RolloutConfig, SamplingSettings
from rlhf_megatron.testing.tiny_models import tiny_hf_config


def _cfg(**overrides):
    return tiny_hf_config("Qwen3ForCausalLM", vocab_size=300, **overrides)


def test_a_valid_config_passes():
    RolloutConfig(max_model_len=256).validate_for_model(_cfg(), on_cpu=True)


def test_unsupported_cpu_head_size_is_refused_but_allowed_on_gpu():
    config = _cfg(head_dim=16)
    with pytest.raises(ConfigError, match="head_dim=16 is unsupported by vLLM's CPU attention"):
        RolloutConfig(max_model_len=128).validate_for_model(config, on_cpu=True)
    RolloutConfig(max_model_len=128).validate_for_model(config, on_cpu=False)


def test_max_model_len_over_the_model_is_refused():
    with pytest.raises(ConfigError, match="max_model_len=4096 exceeds the model's "
                       "max_position_embeddings=256"):
        RolloutConfig(max_model_len=4096).validate_for_model(_cfg(), on_cpu=True)


def test_tp_that_does_not_divide_heads_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide 4 attention heads"):
        RolloutConfig(tensor_parallel_size=3, max_model_len=128).validate_for_model(_cfg(), on_cpu=True)


@pytest.mark.parametrize("kwargs,match", [
    ({"n": 0}, "n=0"), ({"max_tokens": 0}, "max_tokens=0"),
    ({"temperature": -1.0}, "temperature=-1.0"), ({"top_p": 0.0}, "top_p=0.0"),
])
def test_bad_sampling_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingSettings(**kwargs).validate()
