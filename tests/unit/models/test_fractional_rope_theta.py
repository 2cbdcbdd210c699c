"""A fractional `rope_theta` reaches Megatron's rotary embedding unchanged (it used to be passed
as `int(...)`, so 10000.5 became 10000): the inverse frequencies equal HF's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from checkpoint_tools.common import single_rank_group
from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
from rlhf_megatron.parallel import ParallelDims
from rlhf_megatron.platform import Platform
from rlhf_megatron.testing.tiny_models import tiny_hf_config


@pytest.mark.parametrize("theta", [10000.5, 500.75])
def test_megatron_inv_freq_equals_hf_for_a_fractional_rope_theta(theta):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = tiny_hf_config("LlamaForCausalLM", vocab_size=300, num_layers=1,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    args = hf_to_megatron_args(cfg, ARCHITECTURES.for_hf_config(cfg), ParallelDims(1),
                               platform=Platform("cpu", "gloo"))
    assert args.rotary_base == theta
    with single_rank_group():
        (model,) = build_model_chunks(args)
    hf_inv_freq = LlamaRotaryEmbedding(cfg).inv_freq
    truncated = 1.0 / (int(theta) ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    assert not torch.equal(truncated, hf_inv_freq)  # the test can see a truncation
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq, hf_inv_freq, rtol=0, atol=0)
