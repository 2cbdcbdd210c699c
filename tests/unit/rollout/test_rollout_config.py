"""Rollout config errors are caught at start-up, before vLLM is even imported."""

import os

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


@pytest.mark.parametrize("enabled", [True, False])
def test_both_engines_get_sleep_mode_on_cuda_only(tmp_path, enabled):
    """vllm_engine_kwargs is the one place both engines (LLM and AsyncLLM) take their vLLM
    arguments from: on CUDA it passes rollout.engine.enable_sleep_mode, which sleep() relies on
    (the async engine once built its kwargs without it, so a colocated sleep found no pool); on
    CPU, where vLLM has no sleep mode, it passes none."""
    from rlhf_megatron.rollout.vllm_engine import vllm_engine_kwargs

    config = RolloutConfig(max_model_len=128, enable_sleep_mode=enabled)
    cuda = vllm_engine_kwargs(tmp_path, config, on_cuda=True, awaiting_weights=False)
    assert cuda["enable_sleep_mode"] is enabled
    cpu = vllm_engine_kwargs(tmp_path, config, on_cuda=False, awaiting_weights=False)
    assert "enable_sleep_mode" not in cpu and "gpu_memory_utilization" not in cpu


@pytest.mark.parametrize("gb, expected", [(1, 2**30), (0.0625, 64 * 2**20)])
def test_cpu_kv_cache_size_goes_to_vllm_in_bytes_on_cpu_only(tmp_path, gb, expected):
    """rollout.engine.cpu_kv_cache_gb (fractions allowed) is vLLM's kv_cache_memory_bytes on
    CPU, and nothing on CUDA (gpu_memory_utilization sizes it there)."""
    from rlhf_megatron.rollout.vllm_engine import vllm_engine_kwargs

    config = RolloutConfig(max_model_len=128, cpu_kv_cache_gb=gb)
    cpu = vllm_engine_kwargs(tmp_path, config, on_cuda=False, awaiting_weights=False)
    assert cpu["kv_cache_memory_bytes"] == expected
    cuda = vllm_engine_kwargs(tmp_path, config, on_cuda=True, awaiting_weights=False)
    assert "kv_cache_memory_bytes" not in cuda


@pytest.mark.parametrize("gb", [0, -1])
def test_a_kv_cache_of_no_size_is_refused(gb):
    with pytest.raises(ConfigError, match=f"cpu_kv_cache_gb={gb} must be > 0"):
        RolloutConfig(max_model_len=128, cpu_kv_cache_gb=gb).validate_for_model(_cfg(),
                                                                               on_cpu=True)


@pytest.mark.parametrize("on_cuda, exported, disabled", [
    (False, None, True), (False, "0", False), (True, None, False)])
def test_rollout_engines_skip_the_sampler_compile_on_cpu_only(monkeypatch, on_cuda, exported,
                                                              disabled):
    """A CPU rollout engine's process (and the EngineCore child it may spawn, through the
    environment) runs vLLM's one compiled sampler op eagerly: ~1 CPU-s of inductor at every
    engine's first generate, for an integer count that eager computes the same. CUDA keeps
    torch.compile, and so does an exported TORCH_COMPILE_DISABLE=0."""
    import torch._dynamo

    from rlhf_megatron.rollout.vllm_engine import skip_sampler_compile_on_cpu

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", exported or "")  # restored after the test
    if exported is None:
        monkeypatch.delenv("TORCH_COMPILE_DISABLE")
    with torch._dynamo.config.patch(disable=False):  # torch's config, restored on exit
        skip_sampler_compile_on_cpu(on_cuda)
        assert torch._dynamo.config.disable is disabled
    assert (os.environ.get("TORCH_COMPILE_DISABLE") == "1") is disabled
